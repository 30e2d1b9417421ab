"""The prefill role in one process on the CPU: a prompt's KV goes with its handoff (the first token's
log-probabilities, the stages run here), a prompt whose KV cannot be sent fails alone, reported through
`poll_failures`, and an abort in any state gives its pages back."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.messages import PrefillHandoff, PrefillRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import ExpectedTransfer
from pdserve.kvtransfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from pdserve.model.errors import InvalidRequestError
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint
from pdserve.prefill import PrefillConfig, PrefillWorker

PAGE = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_checkpoint(out, "tiny", dtype="fp32", shard_bytes=2 << 20, progress=False)
    return load_model(out, dtype=torch.float32)


def worker(model, hub: LoopbackHub | None = None) -> PrefillWorker:
    config = PrefillConfig(
        page_size=PAGE, num_pages=8, max_num_batched_tokens=8, max_prefill_chunk=8
    )
    return PrefillWorker("p0", model, config, LoopbackSender(hub or LoopbackHub()))


def request(rid: str, n: int) -> PrefillRequest:
    return PrefillRequest(rid, list(range(5, 5 + n)), SamplingParams(seed=0), 0, "nobody", 1)


def test_the_kv_goes_with_the_first_token_s_logprobs_and_the_stages_run_here(model):
    hub = LoopbackHub()
    p = worker(model, hub)
    receiver = LoopbackReceiver(hub, "d0", torch.zeros_like(p.runner.cache.data))
    for transfer_id, logprobs in [(1, 2), (2, None)]:
        receiver.expect(ExpectedTransfer(transfer_id, "p0", [transfer_id], time.monotonic() + 60))
        params = SamplingParams(seed=0, logprobs=logprobs)
        p.submit(PrefillRequest(f"r{transfer_id}", [5, 6, 7], params, 0, "d0", transfer_id))
    while p.step():
        pass
    p.close()  # waits for the sends
    results = {r.transfer_id: r for r in receiver.poll()}
    assert sorted(results) == [1, 2] and p.poll_failures() == []
    asked, plain = (PrefillHandoff.from_bytes(results[i].metadata) for i in (1, 2))
    assert len(asked.logprobs.top_ids) == 2 and asked.logprobs.logprob <= 0
    assert plain.logprobs is None
    for handoff in (asked, plain):
        stages = handoff.stages
        assert stages.prefill_s > 0 and stages.prefill_queue_s > 0 and stages.kv_transfer_s > 0
        assert stages.decode_queue_s == 0  # not P's to know


def test_a_failed_send_is_reported_and_frees_the_pages(model):
    p = worker(model)
    p.submit(request("a", 6))
    p.submit(request("b", 5))
    stats = p.stats()
    assert (stats.num_queued, stats.queued_tokens, stats.pages_used) == (2, 11, 0)
    while p.step():
        pass
    p.close()  # waits for the sends
    failures = p.poll_failures()
    assert sorted(f.request_id for f in failures) == ["a", "b"]
    assert all(
        f.error.startswith("prefill worker p0: KV transfer 1: no decode worker") for f in failures
    )
    assert p.stats().pages_used == 0 and p.poll_failures() == []


def test_abort_while_queued_or_prefilling_frees_the_pages(model):
    p = worker(model)
    p.submit(request("a", 12))  # two steps of 8 tokens
    p.submit(request("b", 30))  # 8 pages: waits for a's
    assert p.step() and p.stats().pages_used == 3
    p.abort("b")
    p.abort("a")
    assert p.stats().num_queued == 0 and p.stats().pages_used == 0 and not p.step()
    with pytest.raises(InvalidRequestError, match="prompt_token_ids: id 100000"):
        p.submit(PrefillRequest("c", [100000], SamplingParams(seed=0), 0, "nobody", 1))
    p.close()
