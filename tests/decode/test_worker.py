"""The decode role in one process on the CPU: aggregated requests (prefilled here) and disaggregated ones (a
prefill worker's KV through the in-process loopback transfer) stream the tokens `pdserve offline` generates, and
every page comes back; log-probabilities are the model's own log-softmax on both paths; a penalized request
follows the penalties' formulas and continues alike when prefilled again with the tokens it had."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from pdserve.decode import DecodeConfig, DecodeWorker
from pdserve.engine.messages import DecodeRequest, PrefillRequest
from pdserve.engine.offline import OfflineGenerator
from pdserve.engine.pages import pages_needed
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint
from pdserve.prefill import PrefillConfig, PrefillWorker

PAGE = 4
PROMPTS = [list(range(5, 5 + n)) for n in (3, 11, 6)]
PARAMS = [
    SamplingParams(max_tokens=6, ignore_eos=True, seed=1),
    # penalties, min_tokens and logprobs travel in the plan and the results (also to and from other ranks)
    SamplingParams(
        max_tokens=9,
        temperature=0.9,
        top_k=40,
        seed=2,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        min_tokens=3,
        logprobs=2,
    ),  # fmt: skip
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
            if out.logprobs is not None:  # a first token a prefill worker sampled has its own too
                assert len(out.logprobs) == len(out.token_ids)
                assert all(len(lp.top_ids) == 2 for lp in out.logprobs)
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


def assert_speculated(got: dict, want: dict) -> None:
    """Greedy requests' tokens equal, sampled ones' counts and finish reasons (`PARAMS`)."""
    for i, params in enumerate(PARAMS):
        (tokens, reason), (want_tokens, want_reason) = got[f"r{i}"], want[f"r{i}"]
        assert reason == want_reason and len(tokens) == len(want_tokens)
        if params.temperature == 0:
            assert tokens == want_tokens, i


def test_speculating_aggregated_requests_give_the_offline_tokens(model):
    """With MTP drafts: the greedy requests get the offline tokens of one token a step; the sampled one as
    many tokens (its draws depend on the drafts, which depend on the batch)."""
    config = DecodeConfig(
        page_size=PAGE, num_pages=32, max_prefill_chunk=4, num_speculative_tokens=2
    )
    decode = DecodeWorker("d0", model, config)
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        decode.add_request(DecodeRequest(f"r{i}", prompt, params))
    assert_speculated(drain(decode, ["r0", "r1", "r2"]), offline(model))
    assert decode.scheduler.spec_stats.drafted > 0
    assert decode.stats().pages_used == 0


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
                PrefillRequest(
                    f"r{i}",
                    prompt,
                    params,
                    0,
                    "d0",
                    reservation.transfer_id,
                    num_held_pages=reservation.num_held_pages,
                )  # fmt: skip
            )
        assert prefill.stats().queued_tokens == sum(map(len, PROMPTS))
        assert drain(decode, ["r0", "r1", "r2"], prefill) == offline(model)
    finally:
        prefill.close()
    assert decode.stats().pages_used == 0 and prefill.stats().pages_used == 0
    assert prefill.poll_failures() == []


def test_the_first_output_of_a_request_prefilled_elsewhere_is_complete(model):
    """Its first output carries what came with the KV: the first token's log-probabilities, and the stages the
    prefill worker ran with the transfer's; the finishing output adds the wait for the first decode step."""
    hub = LoopbackHub()
    decode = DecodeWorker(
        "d0", model, DecodeConfig(page_size=PAGE, num_pages=32),
        make_receiver=lambda cache: LoopbackReceiver(hub, "d0", cache),
    )  # fmt: skip
    prefill = PrefillWorker(
        "p0", model, PrefillConfig(page_size=PAGE, num_pages=32), LoopbackSender(hub)
    )
    params = SamplingParams(max_tokens=3, seed=7, logprobs=1, ignore_eos=True)
    outputs = []
    try:
        reservation = decode.add_request(DecodeRequest("r", PROMPTS[1], params, "p0"))
        prefill.submit(PrefillRequest("r", PROMPTS[1], params, 0, "d0", reservation.transfer_id))
        deadline = time.monotonic() + 120
        while not outputs or outputs[-1].finish_reason is None:
            assert time.monotonic() < deadline
            prefill.step()
            decode.step()
            outputs += decode.poll_outputs()
    finally:
        prefill.close()
    first, last = outputs[0], outputs[-1]
    assert len(first.token_ids) == 1 and len(first.logprobs[0].top_ids) == 1
    assert first.logprobs[0].logprob <= 0
    s = first.stages
    assert s.prefill_queue_s > 0 and s.prefill_s > 0 and s.kv_transfer_s > 0
    assert s.decode_queue_s == 0  # not known yet
    assert [o.stages for o in outputs[1:-1]] == [None] * (len(outputs) - 2)
    assert last.stages == dataclasses.replace(s, decode_queue_s=last.stages.decode_queue_s)
    assert last.stages.decode_queue_s > 0


class DirectModel:
    """The model's raw logits [V] for the token after a growing sequence: its own forward over a fresh cache,
    the prompt at once, then one token per call (the reference for what the sampler is given)."""

    def __init__(self, model, prompt: list[int], max_len: int):
        self.model, self.num_tokens = model, len(prompt)
        self.pages = list(range(pages_needed(max_len, PAGE)))
        self.cache = ModelRunner(model, PAGE, len(self.pages), cuda_graphs=False).cache
        self.logits = self._forward(SeqChunk(prompt, 0, self.pages), decode=False)

    def push(self, token: int) -> None:
        self.logits = self._forward(SeqChunk([token], self.num_tokens, self.pages), decode=True)
        self.num_tokens += 1

    @torch.inference_mode()
    def _forward(self, chunk: SeqChunk, decode: bool) -> torch.Tensor:
        batch = build_forward_batch([chunk], PAGE, "cpu", decode=decode)
        hidden = self.model(batch, self.cache)
        return self.model.compute_logits(hidden[batch.logits_indices])[0].float()


def drain_logprobs(decode: DecodeWorker, request_id: str, prefill: PrefillWorker | None = None):
    """Steps until the request finishes; its tokens and their log-probabilities (the first token's, sampled by
    the prefill worker, in the decode worker's first output)."""
    tokens, logprobs = [], []
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline
        if prefill is not None:
            prefill.step()
        decode.step()
        for out in decode.poll_outputs():
            assert out.error is None, out.error
            tokens += out.token_ids
            logprobs += out.logprobs
            if out.finish_reason is not None:
                return tokens, logprobs


def test_logprobs_are_the_model_s_log_softmax_aggregated_and_disaggregated(model):
    prompt = list(range(7, 20))
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=7, logprobs=3, ignore_eos=True)
    config = DecodeConfig(page_size=PAGE, num_pages=32)
    decode = DecodeWorker("d0", model, config)
    decode.add_request(DecodeRequest("a", prompt, params))
    aggregated = drain_logprobs(decode, "a")
    hub = LoopbackHub()
    decode = DecodeWorker(
        "d0", model, config, make_receiver=lambda cache: LoopbackReceiver(hub, "d0", cache)
    )
    prefill = PrefillWorker(
        "p0", model, PrefillConfig(page_size=PAGE, num_pages=32), LoopbackSender(hub)
    )
    try:
        reservation = decode.add_request(DecodeRequest("b", prompt, params, "p0"))
        prefill.submit(PrefillRequest("b", prompt, params, 0, "d0", reservation.transfer_id))
        disaggregated = drain_logprobs(decode, "b", prefill)
    finally:
        prefill.close()
    tokens, _ = aggregated
    assert disaggregated[0] == tokens and len(tokens) == 3
    direct = DirectModel(model, prompt, len(prompt) + len(tokens))
    for i, token in enumerate(tokens):
        reference = torch.log_softmax(direct.logits, -1)
        direct.push(token)
        values, ids = reference.topk(3)
        for lp in (aggregated[1][i], disaggregated[1][i]):
            assert lp.logprob == pytest.approx(reference[token].item(), abs=1e-4)
            assert lp.top_ids == tuple(ids.tolist())
            assert lp.top_logprobs == pytest.approx(values.tolist(), abs=1e-4)


def test_penalized_greedy_follows_the_formula_and_survives_a_move(model):
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    # a negative presence penalty draws the output back to its own tokens, the frequency penalty away again
    penalties = {"presence_penalty": -2.0, "frequency_penalty": 1.0, "repetition_penalty": 0.8}
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=0, **penalties)
    expected: list[int] = []
    moved = 0  # steps where the penalties change the greedy choice
    direct = DirectModel(model, prompt, len(prompt) + 6)
    for _ in range(6):
        logits = direct.logits
        # Hugging Face's repetition penalty over prompt + output, then OpenAI's over the output
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt + expected] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / 0.8, logits * 0.8), logits)
        counts = torch.bincount(torch.tensor(expected, dtype=torch.long), minlength=logits.numel())
        logits = logits - 1.0 * counts + 2.0 * (counts > 0).float()
        expected.append(int(logits.argmax()))
        moved += expected[-1] != int(direct.logits.argmax())
        direct.push(expected[-1])
    assert moved > 0
    decode = DecodeWorker("d0", model, DecodeConfig(page_size=PAGE, num_pages=32))
    decode.add_request(DecodeRequest("a", prompt, params))
    # moved after 3 tokens: prefilled again with the prompt and the tokens already sent
    decode.add_request(DecodeRequest("b", prompt, params, generated_token_ids=expected[:3]))
    got = drain(decode, ["a", "b"])
    assert got["a"] == (expected, "length")
    assert got["b"] == (expected[3:], "length")


def test_speculating_requests_preempted_for_pages_keep_the_offline_tokens(model):
    """Six greedy requests with MTP drafts in a cache too small for them all (drafts' rows need pages ahead):
    preempted ones are prefilled again and go on with the tokens of one token a step; every page comes back."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [list(range(3 + i, 30 + i)) for i in range(6)]
    config = DecodeConfig(
        page_size=PAGE, num_pages=60, max_prefill_chunk=16, num_speculative_tokens=2,
        speculative_min_acceptance=0.0,
    )  # fmt: skip
    decode = DecodeWorker("d0", model, config)
    for i, prompt in enumerate(prompts):
        decode.add_request(DecodeRequest(f"r{i}", prompt, params))
    got = drain(decode, [f"r{i}" for i in range(6)])
    want = OfflineGenerator(model, PAGE)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"][0] == want.generate(prompt, params).token_ids, i
    assert decode.scheduler.num_preemptions > 0 and decode.num_used_pages == 0
