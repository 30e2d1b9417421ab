"""MTP speculation on a GPU, verify and draft passes replayed as CUDA graphs: in batch-invariant mode a batch of
greedy requests gets the tokens of one token a step (oracle drafts of acceptance 1 and 0.6, and the model's own
MTP drafts), sampled requests in the same batches run, and the draft graphs give the eager drafts."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.engine.drafter import OracleDrafter
from pdserve.engine.pages import PageAllocator
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", "tiny", dtype="bf16")
    return load_model(path, "cuda", torch.bfloat16, progress=False)


def generate(model, prompts, params, num_drafts=0, drafter=None, graphs=True):
    runner = ModelRunner(model, 16, 40 * len(prompts), cuda_graphs=graphs)
    if drafter is not None:
        runner.drafter = drafter(model, runner.cache)
    scheduler = Scheduler(
        PageAllocator(runner.num_pages), 16, 512, 512, model.args.vocab_size,
        model.args.max_position_embeddings, [], max_running=len(prompts), num_drafts=num_drafts,
    )  # fmt: skip
    requests = [
        Request(str(i), list(p), params[i % len(params)].with_seed(), Policy.AGGREGATED)
        for i, p in enumerate(prompts)
    ]
    for r in requests:
        scheduler.add(r)
    while any(r.state not in (RequestState.FINISHED, RequestState.ABORTED) for r in requests):
        plan, _ = scheduler.schedule()
        result = runner.execute(plan)
        assert result.decode_error is None and result.prefill_error is None
        scheduler.finish_step(plan, [result])
    return [r.token_ids[len(p) :] for r, p in zip(requests, prompts, strict=True)], requests


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_greedy_batches_with_graphs_give_one_token_a_steps_tokens(model, num_drafts):
    g = torch.Generator().manual_seed(num_drafts)
    prompts = [torch.randint(3, 1000, (20 + 7 * i,), generator=g).tolist() for i in range(5)]
    greedy = [SamplingParams(max_tokens=20, ignore_eos=True)]
    with kernels.use_batch_invariant():
        base, _ = generate(model, prompts, greedy)
        seqs = {str(i): p + base[i] for i, p in enumerate(prompts)}
        for acceptance in (1.0, 0.6):
            out, requests = generate(
                model, prompts, greedy, num_drafts,
                lambda m, c, a=acceptance: OracleDrafter(m, c, seqs, a, seed=2),
            )  # fmt: skip
            assert out == base, acceptance
            accepted = sum(r.num_accepted for r in requests)
            drafted = sum(r.num_drafted for r in requests)
            assert (accepted == drafted) if acceptance == 1.0 else (0 < accepted < drafted)
        out, requests = generate(model, prompts, greedy, num_drafts)
        assert out == base and sum(r.num_drafted for r in requests) > 0
        mixed = greedy + [
            SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, ignore_eos=True)
        ]
        out, _ = generate(model, prompts, mixed, num_drafts)
        assert [o for i, o in enumerate(out) if i % 2 == 0] == base[::2]


def test_draft_graphs_give_the_eager_drafts(model):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1000, (30,), generator=g).tolist() for _ in range(3)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)]
    with kernels.use_batch_invariant():
        _, graphed = generate(model, prompts, params, 2)
        _, eager = generate(model, prompts, params, 2, graphs=False)
    assert [r.num_accepted for r in graphed] == [r.num_accepted for r in eager]
    assert [r.num_drafted for r in graphed] == [r.num_drafted for r in eager]
