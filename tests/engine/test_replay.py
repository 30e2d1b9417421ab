"""A request that comes back with generated tokens (preempted, or moved off a lost worker) goes on exactly as the
uninterrupted run in batch-invariant mode: the scheduler prefills its prompt and replays its generated tokens as
decode rows (`Scheduler.replay_generated`), so its cache holds the same bits and it samples the same tokens. On a
GPU, prefilling those tokens instead leaves other bits (the prefill kernels' sums run in another order): that is
why the replay exists."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.engine.pages import PageAllocator, pages_needed
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint

PAGE, CHUNK, MAX_TOKENS = 16, 32, 24


def run(
    model, device, token_ids, num_generated, replay, max_running=None, steps=None
) -> tuple[list[int], torch.Tensor]:
    """Runs one aggregated request (greedy, EOS ignored) to MAX_TOKENS generated tokens in a fresh cache; its
    tokens, and the cache's pages it used. max_running: rows a step may hold (a replay takes the spare ones);
    steps: a list the steps' decode rows are appended to."""
    args = model.args
    num_pages = pages_needed(len(token_ids) - num_generated + MAX_TOKENS, PAGE)
    runner = ModelRunner(model, PAGE, num_pages, cuda_graphs=False)
    scheduler = Scheduler(
        PageAllocator(num_pages), PAGE, CHUNK, CHUNK, args.vocab_size, args.max_position_embeddings,
        args.eos_token_ids, max_running=max_running, fixed_chunks=True, replay_generated=replay,
    )  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=0)
    request = Request("r", list(token_ids), params, Policy.AGGREGATED, num_generated=num_generated)
    scheduler.add(request)
    with torch.inference_mode():
        while request.state is not RequestState.FINISHED:
            assert request.state is not RequestState.ABORTED
            plan, _ = scheduler.schedule()
            if steps is not None:
                steps.append(len(plan.ranks[0].decode))
            scheduler.finish_step(plan, [runner.execute(plan)])
    return request.token_ids, runner.cache.data[:num_pages].clone()


def check_replay(model, device, invariant: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Asserts that runs resumed after 1 and after 9 generated tokens, replayed a row a step or (with
    max_running rows a step) several rows of one step, equal the uninterrupted run (tokens, and with
    `invariant` kernels the cache bit for bit); returns the uninterrupted cache and that of the run resumed
    after 9 tokens without replay."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.args.vocab_size, (45,), generator=g).tolist()
    whole, cache = run(model, device, prompt, 0, replay=True)  # nothing to replay: the plain path
    for k, max_running in ((1, None), (9, None), (9, 4), (9, 16)):
        steps: list[int] = []
        tokens, resumed = run(
            model, device, whole[: len(prompt) + k], k, True, max_running, steps
        )  # fmt: skip
        assert tokens == whole, (k, max_running)
        if invariant or max_running is None:
            assert torch.equal(resumed.view(torch.uint8), cache.view(torch.uint8)), (k, max_running)
        # the 9 known tokens replay a row a step, or several rows of one step: 4 + 4 + 1, or 9 at once
        replaying = {None: [1] * 9, 4: [4, 4, 1], 16: [9]}[max_running][: k if k == 1 else None]
        first = next(i for i, n in enumerate(steps) if n)  # the first step after the prefill
        assert steps[first : first + len(replaying)] == replaying, steps
    tokens, prefilled = run(model, device, whole[: len(prompt) + 9], 9, replay=False)
    return cache, prefilled


def test_replay_on_cpu(tmp_path):
    """torch's reference kernels: the replay's tokens, and its bits where it replays a row a step (the CPU's
    matmuls are not batch-invariant: several rows of one step may round otherwise; the GPU test checks those
    bits in batch-invariant mode)."""
    path = make_checkpoint(tmp_path / "tiny", "tiny", dtype="fp32", progress=False)
    check_replay(load_model(path, dtype=torch.float32, progress=False), "cpu", invariant=False)


@pytest.mark.gpu
def test_replay_on_gpu_in_batch_invariant_mode(v2lite_dir):
    model = load_model(v2lite_dir, "cuda", torch.bfloat16, progress=False)
    with kernels.use_batch_invariant():
        cache, prefilled = check_replay(model, "cuda")
    assert not torch.equal(prefilled.view(torch.uint8), cache.view(torch.uint8)), (
        "prefilling the generated tokens gave the decode rows' bits: the replay would be needed no more"
    )
