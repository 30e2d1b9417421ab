"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`) on the tiny fp32 model (CPU): each prompt token's
log-probability and alternatives equal a direct log-softmax of the model's logits at every position, prefilled
whole or in chunks, on an aggregated worker with the prefix cache holding the prompt (which must not serve it),
and through a prefill worker's handoff; prompts past the bound are refused by name."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from pdserve.decode import DecodeConfig, DecodeWorker
from pdserve.engine import runner as runner_module
from pdserve.engine.messages import (
    DecodeRequest,
    PackedLogprobs,
    PrefillHandoff,
    RequestOutput,
    StageTimes,
)
from pdserve.engine.offline import OfflineGenerator
from pdserve.engine.pages import PageAllocator, pages_needed
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling_params import MAX_PROMPT_LOGPROBS, SamplingParams, TokenLogprobs
from pdserve.engine.scheduler import Scheduler
from pdserve.kvtransfer.base import MAX_METADATA_BYTES
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.errors import InvalidRequestError, TransferError

PAGE = 4


def prompt_ids(n: int, seed: int, vocab: int = 1000) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def direct_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every prompt position, from one forward on a fresh cache: [P, V]."""
    num_pages = pages_needed(len(prompt), 64)
    cache = ModelRunner(model, 64, num_pages, cuda_graphs=False).cache
    chunk = SeqChunk(prompt, 0, list(range(num_pages)))
    batch = build_forward_batch([chunk], 64, "cpu", decode=False, all_logits=True)
    with torch.inference_mode():
        hidden = model(batch, cache)
        return torch.log_softmax(model.compute_logits(hidden[batch.logits_indices]).float(), -1)


def assert_matches(got: list[TokenLogprobs], model, prompt: list[int], k: int) -> None:
    want = direct_logprobs(model, prompt)
    assert len(got) == len(prompt) - 1
    for i, lp in enumerate(got):  # entry i: prompt token i + 1, scored at position i
        torch.testing.assert_close(lp.logprob, want[i, prompt[i + 1]].item(), rtol=1e-4, atol=1e-4)
        assert lp.rank == int((want[i] > want[i, prompt[i + 1]]).sum()) + 1, i
        top = torch.topk(want[i], k)
        assert list(lp.top_ids) == top.indices.tolist(), i
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), top.values, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk, k", [(None, 3), (5, 0), (8, 3)])
def test_prompt_logprobs_equal_a_log_softmax_of_every_position(
    reference_model, chunk, k, monkeypatch
):
    # logits made in blocks, as a long prompt's are
    monkeypatch.setattr(runner_module, "PROMPT_LOGITS_ROWS", 3)
    prompt = prompt_ids(19, 0)
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=k, seed=1)
    got = OfflineGenerator(reference_model, PAGE, prefill_chunk=chunk).generate(prompt, params)
    assert_matches(got.prompt_logprobs, reference_model, prompt, k)
    # the generated tokens are those of a request that asked for none
    plain = OfflineGenerator(reference_model, PAGE, prefill_chunk=chunk).generate(
        prompt, SamplingParams(max_tokens=2, ignore_eos=True, seed=1)
    )
    assert got.token_ids == plain.token_ids and plain.prompt_logprobs is None


def test_a_one_token_prompt_has_no_prompt_logprobs(reference_model):
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    assert OfflineGenerator(reference_model, PAGE).generate([7], params).prompt_logprobs == []


def serve(worker: DecodeWorker, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Adds the requests together and steps the worker until each finished; per request its outputs."""
    got: dict[str, list[RequestOutput]] = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        worker.add_request(DecodeRequest(rid, prompt, params))
    done: set[str] = set()
    deadline = time.monotonic() + 60
    while len(done) < len(requests):
        assert time.monotonic() < deadline, f"unfinished: {set(got) - done}"
        worker.step()
        for out in worker.poll_outputs():
            assert out.error is None, out.error
            got[out.request_id].append(out)
            if out.finish_reason is not None:
                done.add(out.request_id)
    return got


def test_the_prefix_cache_serves_no_request_that_scores_its_prompt(reference_model):
    """The prompt is cached by a first request; asked again with prompt log-probabilities (beside a request
    for the same prompt without them, which still finds it cached) it is prefilled in full, in chunks, and
    scored like the model's own log-softmax."""
    config = DecodeConfig(
        page_size=PAGE, num_pages=96, max_prefill_chunk=8, enable_prefix_caching=True
    )
    worker = DecodeWorker("d0", reference_model, config)
    prompt = prompt_ids(22, 1)
    plain = SamplingParams(max_tokens=2, ignore_eos=True, seed=3)
    first = serve(worker, [("a", prompt, plain)])
    scored = SamplingParams(max_tokens=2, ignore_eos=True, seed=3, prompt_logprobs=2)
    got = serve(worker, [("scored", prompt, scored), ("again", prompt, plain)])
    assert got["again"][0].num_cached_tokens == 20  # the cache holds the prompt's full pages
    out = got["scored"]
    assert out[0].num_cached_tokens in (None, 0)
    assert [o.prompt_logprobs is not None for o in out] == [True] + [False] * (len(out) - 1)
    assert_matches(out[0].prompt_logprobs, reference_model, prompt, 2)
    tokens = [t for o in out for t in o.token_ids]
    assert tokens == [t for o in first["a"] for t in o.token_ids]
    assert worker.stats().pages_used == 0


def test_prompt_logprobs_travel_packed_in_the_prefill_handoff():
    lps = [TokenLogprobs(-1.5, (4, 9), (-0.25, -1.5), 3), TokenLogprobs(-3.0, (4, 7), (-0.5, -1.0))]
    handoff = PrefillHandoff(prompt_logprobs=PackedLogprobs.of(lps))
    assert PrefillHandoff.from_bytes(handoff.to_bytes()).prompt_logprobs.unpacked() == lps
    assert PrefillHandoff.from_bytes(PrefillHandoff().to_bytes()).prompt_logprobs is None
    assert PackedLogprobs.of([]).unpacked() == []
    with pytest.raises(ValueError, match="alternatives"):
        PackedLogprobs.of([TokenLogprobs(-1.0, (4,), (-1.0,)), TokenLogprobs(-2.0)])
    torn = dataclasses.replace(PackedLogprobs.of(lps), ranks=b"")
    with pytest.raises(TransferError, match="unequal"):
        torn.unpacked()


@pytest.mark.parametrize("k", [0, 1, 20])
def test_the_most_prompt_logprobs_a_request_may_ask_for_fit_a_transfer_s_metadata(k):
    n = MAX_PROMPT_LOGPROBS // (1 + k)
    rng = random.Random(k)
    lps = [
        TokenLogprobs(-rng.random() * 30, tuple(rng.randrange(1 << 17) for _ in range(k)),
                      tuple(-rng.random() for _ in range(k)), rng.randrange(1, 1 << 17))
        for _ in range(n)
    ]  # fmt: skip
    handoff = PrefillHandoff(
        StageTimes(), draft_ids=(1, 2, 3), prompt_logprobs=PackedLogprobs.of(lps)
    )
    assert len(handoff.to_bytes()) <= MAX_METADATA_BYTES


def test_prompts_past_the_bound_and_bad_values_are_refused_by_name(reference_model):
    args = reference_model.args
    s = Scheduler(
        PageAllocator(1 << 14), PAGE, 64, 64, args.vocab_size, 1 << 20, args.eos_token_ids
    )  # fmt: skip
    k = 3
    n = MAX_PROMPT_LOGPROBS // (1 + k) + 1
    params = SamplingParams(max_tokens=1, prompt_logprobs=k)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs") as e:
        s.check(Request("long", [5] * n, params, Policy.AGGREGATED))
    assert e.value.field == "prompt_logprobs"
    s.check(Request("fits", [5] * (n - 1), params, Policy.AGGREGATED))
    for bad in (-1, True, 1.5):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_a_request_preempted_mid_prefill_reports_the_scores_of_its_prefill_again(reference_model):
    """Preempted after its first chunks, it is prefilled again from its start (the prefix cache serves it
    nothing): its prompt log-probabilities are those of the prefill that finished, once."""
    args = reference_model.args
    runner = ModelRunner(reference_model, PAGE, 32, cuda_graphs=False)
    s = Scheduler(
        PageAllocator(32), PAGE, 6, 6, args.vocab_size, args.max_position_embeddings,
        args.eos_token_ids, prefix_caching=True,
    )  # fmt: skip
    prompt = prompt_ids(17, 2)
    r = Request(
        "r", list(prompt), SamplingParams(max_tokens=2, prompt_logprobs=1), Policy.AGGREGATED
    )
    s.add(r)
    outputs = []
    for _ in range(2):  # two chunks of 6
        plan, _ = s.schedule()
        outputs += s.finish_step(plan, [runner.execute(plan)]).outputs
    assert r.num_computed == 12 and len(r.prompt_logprobs) == 12
    r.prompt_logprobs = [TokenLogprobs(0.0)] * 12  # what a prefill again must overwrite
    s._preempt(r)
    while r.state is not RequestState.FINISHED:
        plan, more = s.schedule()
        outputs += more + s.finish_step(plan, [runner.execute(plan)]).outputs
    reported = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(reported) == 1
    assert_matches(reported[0], reference_model, prompt, 1)
