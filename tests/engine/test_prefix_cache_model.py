"""The prefix cache on the tiny fp32 model (CPU): an aggregated decode worker's requests that find their prompt's
first pages cached (the same prompt again, a prompt that shares a prefix, the next turn of a conversation) get
the tokens and log-probabilities of a worker without the cache, with speculation too, and with fp8 cache rows
(to fp8's rounding); a hit followed by the MTP module's passes leaves in the request's pages, its MTP layer
included, the rows it would have computed itself, and drafts alike; and in batch-invariant mode (prompts cut at
chunk multiples) a hit leaves the bits of no hit."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.decode import DecodeConfig, DecodeWorker
from pdserve.engine.messages import DecodeRequest
from pdserve.engine.pages import PageAllocator
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler

PAGE = 4
GREEDY = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2, seed=1)
SAMPLED = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.8, seed=7)


def prompt_ids(n: int, seed: int, vocab: int = 1000) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(worker: DecodeWorker, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Adds the requests, steps the worker until each finished; per request its tokens, log-probabilities
    and the cached tokens its first output reported."""
    got = {rid: ([], [], None) for rid, _, _ in requests}
    for rid, prompt, params in requests:
        worker.add_request(DecodeRequest(rid, prompt, params))
    done: set[str] = set()
    deadline = time.monotonic() + 60
    while len(done) < len(requests):
        assert time.monotonic() < deadline, f"unfinished: {set(got) - done}"
        worker.step()
        for out in worker.poll_outputs():
            assert out.error is None, out.error
            tokens, logprobs, cached = got[out.request_id]
            tokens += out.token_ids
            logprobs += out.logprobs or []
            if out.num_cached_tokens is not None:
                assert cached is None, "reported twice"
                cached = out.num_cached_tokens
            got[out.request_id] = (tokens, logprobs, cached)
            if out.finish_reason is not None:
                done.add(out.request_id)
    return got


def turns(worker: DecodeWorker, sampled: bool = True) -> dict:
    """A prompt, then (once it finished) the same prompt again, a prompt sharing its first 14 tokens, and
    the next turn of its conversation (the prompt, its answer, more), greedy, and (`sampled`) one
    sampled."""
    base = prompt_ids(22, 0)
    got = serve(worker, [("a", base, GREEDY)])
    answer = got["a"][0]
    more = [
        ("same", base, GREEDY),
        ("shared", base[:14] + prompt_ids(7, 1), GREEDY),
        ("next turn", base + answer + prompt_ids(4, 2), GREEDY),
        *([("sampled", base + prompt_ids(3, 3), SAMPLED)] if sampled else []),
    ]
    return got | serve(worker, more)


def assert_same_outputs(got: dict, want: dict, tol: float = 1e-4) -> None:
    for rid, (tokens, logprobs, _) in want.items():
        assert got[rid][0] == tokens, rid
        for a, b in zip(got[rid][1], logprobs, strict=True):
            assert a.top_ids == b.top_ids, rid
            torch.testing.assert_close(a.logprob, b.logprob, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_drafts, kv_cache_dtype", [(0, "auto"), (2, "auto"), (0, "fp8")])
def test_hits_give_the_outputs_of_no_cache(reference_model, num_drafts, kv_cache_dtype):
    def worker(caching: bool) -> DecodeWorker:
        config = DecodeConfig(
            page_size=PAGE, num_pages=96, max_prefill_chunk=16, enable_prefix_caching=caching,
            num_speculative_tokens=num_drafts, speculative_min_acceptance=0.0,
        )  # fmt: skip
        return DecodeWorker("d0", reference_model, config, kv_cache_dtype=kv_cache_dtype)

    cached, plain = worker(True), worker(False)
    # with drafts, sampled draws depend on the drafts, which depend on the batch: greedy ones only
    got, want = turns(cached, not num_drafts), turns(plain, not num_drafts)
    reported = {rid: c for rid, (_, _, c) in got.items()}
    # full pages within all but the last token that an earlier prompt's prefill computed; the next turn's
    # also the page of "a"'s answer its decode rows computed (kept once it finished), but where the worker
    # speculates (its MTP module writes rows ahead of a decode row) only its prompt's
    expected = {"a": 0, "same": 20, "shared": 12, "next turn": 24, "sampled": 20}
    if num_drafts:
        expected["next turn"] = 20
        del expected["sampled"]
    assert reported == expected
    assert all(c is None for _, _, c in want.values())
    # fp8 rows: a chunk attends to its own keys as computed and to the cached ones read back from fp8, so
    # where the chunks start (after a hit, or not) moves the logits by fp8's rounding
    assert_same_outputs(got, want, 2e-2 if kv_cache_dtype == "fp8" else 1e-4)
    stats = cached.stats()
    assert stats.prefix_cache_hits == sum(reported.values()) and stats.pages_used == 0
    assert stats.prefix_cache_queries == 22 + 22 + 21 + 29 + (0 if num_drafts else 25)
    assert plain.stats().prefix_cache_queries == 0


def prefill(
    model, prompts: list[list[int]], num_drafts: int = 0, fixed_chunks: bool = False
) -> tuple[torch.Tensor, Request]:
    """Runs the prompts one after another (each to the end of its prefill, the one before it finishing
    meanwhile) on one scheduler and runner with the prefix cache, 8-token chunks; returns the last one's
    cache rows [positions, layers, entry] (the MTP layer's included) and its record."""
    runner = ModelRunner(model, PAGE, 64, cuda_graphs=False)
    args = model.args
    s = Scheduler(
        PageAllocator(64), PAGE, 64, 8, args.vocab_size, args.max_position_embeddings,
        args.eos_token_ids, num_drafts=num_drafts, prefix_caching=True, fixed_chunks=fixed_chunks,
    )  # fmt: skip
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        r = Request(f"r{i}", list(prompt), params, Policy.AGGREGATED)
        s.add(r)
        while r.state is RequestState.PREFILLING:
            plan, _ = s.schedule()
            s.finish_step(plan, [runner.execute(plan)])
    rows = runner.cache.data[r.pages]  # [P, layers, page, entry]
    rows = rows.transpose(1, 2).flatten(0, 1)  # [P * page, layers, entry]
    return rows[: len(r.token_ids) - 1].clone(), r


def test_a_hit_leaves_the_mtp_rows_and_drafts_it_would_have_computed(reference_model):
    """A and B share 12 tokens (3 pages) and go on differently: the MTP layer's row at position 11 was made
    with A's token 12, so B finds only 2 pages and computes the third itself."""
    shared = prompt_ids(12, 4)
    a, b = shared + prompt_ids(5, 5), shared + prompt_ids(5, 6)
    assert a[12] != b[12]
    want, alone = prefill(reference_model, [b], num_drafts=1)
    got, after_a = prefill(reference_model, [a, b], num_drafts=1)
    assert (alone.num_cached_tokens, after_a.num_cached_tokens) == (0, 8)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert after_a.token_ids == alone.token_ids and after_a.draft_ids == alone.draft_ids


def test_batch_invariant_hits_leave_the_bits_of_no_hit(reference_model):
    """With prompts cut only at multiples of the chunk (batch-invariant mode) a hit is whole chunks, so the
    request computes the chunks it would have computed alone: on the CPU's reference kernels (deterministic
    for a given shape) its cache rows and first token are the same bits, where a hit of every full page
    (20 tokens, a chunk starting at 20) would leave other bits."""
    shared = prompt_ids(22, 7)
    a, b = shared + prompt_ids(3, 8), shared + prompt_ids(4, 9)
    want, alone = prefill(reference_model, [b], fixed_chunks=True)
    got, after_a = prefill(reference_model, [a, b], fixed_chunks=True)
    assert (alone.num_cached_tokens, after_a.num_cached_tokens) == (0, 16)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert after_a.token_ids == alone.token_ids
