"""The decode role in one process on the CPU: aggregated requests (prefilled here) and disaggregated ones (a
prefill worker's KV through the in-process loopback transfer) stream the tokens `pdserve offline` generates, and
every page comes back."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.decode import DecodeConfig, DecodeWorker
from pdserve.engine.messages import DecodeRequest, PrefillRequest
from pdserve.engine.offline import OfflineGenerator
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint
from pdserve.prefill import PrefillConfig, PrefillWorker

PAGE = 4
PROMPTS = [list(range(5, 5 + n)) for n in (3, 11, 6)]
PARAMS = [
    SamplingParams(max_tokens=6, ignore_eos=True, seed=1),
    SamplingParams(max_tokens=9, temperature=0.9, top_k=40, seed=2),
    SamplingParams(max_tokens=5, ignore_eos=True, seed=3),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_checkpoint(out, "tiny", dtype="fp32", shard_bytes=2 << 20, progress=False)
    return load_model(out, dtype=torch.float32)


def drain(decode: DecodeWorker, ids: list[str], prefill: PrefillWorker | None = None):
    """Steps the workers until every request finished; returns each one's tokens and finish reason."""
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str] = {}
    deadline = time.monotonic() + 120
    while len(reasons) < len(ids):
        assert time.monotonic() < deadline, f"unfinished: {set(ids) - set(reasons)}"
        if prefill is not None:
            prefill.step()
        decode.step()
        for out in decode.poll_outputs():
            assert out.error is None, out.error
            tokens[out.request_id] += out.token_ids
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    return {i: (tokens[i], reasons[i]) for i in ids}


def offline(model) -> dict[str, tuple[list[int], str]]:
    generator = OfflineGenerator(model, PAGE)
    results = {}
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        generation = generator.generate(prompt, params)
        results[f"r{i}"] = (generation.token_ids, generation.finish_reason)
    return results


def test_aggregated_requests_give_the_offline_tokens(model):
    decode = DecodeWorker(
        "d0", model, DecodeConfig(page_size=PAGE, num_pages=32, max_prefill_chunk=4)
    )
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        decode.add_request(DecodeRequest(f"r{i}", prompt, params))
    assert drain(decode, ["r0", "r1", "r2"]) == offline(model)
    assert decode.stats().pages_used == 0 and decode.stats().num_running == 0


def test_disaggregated_requests_give_the_offline_tokens(model):
    hub = LoopbackHub()
    decode = DecodeWorker(
        "d0", model, DecodeConfig(page_size=PAGE, num_pages=32),
        make_receiver=lambda cache: LoopbackReceiver(hub, "d0", cache),
    )  # fmt: skip
    prefill = PrefillWorker(
        "p0", model, PrefillConfig(page_size=PAGE, num_pages=32, max_prefill_chunk=8),
        LoopbackSender(hub),
    )  # fmt: skip
    try:
        for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
            reservation = decode.add_request(DecodeRequest(f"r{i}", prompt, params, "p0"))
            prefill.submit(
                PrefillRequest(f"r{i}", prompt, params, 0, "d0", reservation.transfer_id)
            )
        assert prefill.stats().queued_tokens == sum(map(len, PROMPTS))
        assert drain(decode, ["r0", "r1", "r2"], prefill) == offline(model)
    finally:
        prefill.close()
    assert decode.stats().pages_used == 0 and prefill.stats().pages_used == 0
    assert prefill.poll_events() == []
