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


def run(model, device, token_ids, num_generated, replay) -> tuple[list[int], torch.Tensor]:
    """Runs one aggregated request (greedy, EOS ignored) to MAX_TOKENS generated tokens in a fresh cache; its
    tokens, and the cache's pages it used."""
    args = model.args
    num_pages = pages_needed(len(token_ids) - num_generated + MAX_TOKENS, PAGE)
    runner = ModelRunner(model, PAGE, num_pages, cuda_graphs=False)
    scheduler = Scheduler(
        PageAllocator(num_pages), PAGE, CHUNK, CHUNK, args.vocab_size, args.max_position_embeddings,
        args.eos_token_ids, fixed_chunks=True, replay_generated=replay,
    )  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=0)
    request = Request("r", list(token_ids), params, Policy.AGGREGATED, num_generated=num_generated)
    scheduler.add(request)
    with torch.inference_mode():
        while request.state is not RequestState.FINISHED:
            assert request.state is not RequestState.ABORTED
            plan, _ = scheduler.schedule()
            scheduler.finish_step(plan, [runner.execute(plan)])
    return request.token_ids, runner.cache.data[:num_pages].clone()


def check_replay(model, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Asserts that runs resumed after 1 and after 9 generated tokens, replayed, equal the uninterrupted run
    (tokens, and the cache bit for bit); returns the uninterrupted cache and that of the run resumed after 9
    tokens without replay."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.args.vocab_size, (45,), generator=g).tolist()
    whole, cache = run(model, device, prompt, 0, replay=True)  # nothing to replay: the plain path
    for k in (1, 9):
        tokens, resumed = run(model, device, whole[: len(prompt) + k], k, replay=True)
        assert tokens == whole, k
        assert torch.equal(resumed.view(torch.uint8), cache.view(torch.uint8)), k
    tokens, prefilled = run(model, device, whole[: len(prompt) + 9], 9, replay=False)
    return cache, prefilled


def test_replay_on_cpu(tmp_path):
    path = make_checkpoint(tmp_path / "tiny", "tiny", dtype="fp32", progress=False)
    check_replay(load_model(path, dtype=torch.float32, progress=False), "cpu")


@pytest.mark.gpu
def test_replay_on_gpu_in_batch_invariant_mode(v2lite_dir):
    model = load_model(v2lite_dir, "cuda", torch.bfloat16, progress=False)
    with kernels.use_batch_invariant():
        cache, prefilled = check_replay(model, "cuda")
    assert not torch.equal(prefilled.view(torch.uint8), cache.view(torch.uint8)), (
        "prefilling the generated tokens gave the decode rows' bits: the replay would be needed no more"
    )
