"""Decode-side KV reuse on the tiny fp32 model (CPU), disaggregated through the in-process loopback transfer, in
batch-invariant mode: the second turn of a conversation gets from the prefill worker only the pages the decode
worker does not hold from the first (its prompt's full pages; the first turn's decode rows are not kept in this
mode), and its tokens and log-probabilities are the bits of the same two turns with the prefix cache off on
both workers (every page computed and sent)."""

from __future__ import annotations

import time

import torch

from pdserve import kernels
from pdserve.decode import DecodeConfig, DecodeWorker
from pdserve.engine.messages import DecodeRequest, PrefillRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from pdserve.prefill import PrefillConfig, PrefillWorker

PAGE = 4
CHUNK = 8
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=2, seed=1)


def prompt_ids(n: int, seed: int, vocab: int = 1000) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(p: PrefillWorker, d: DecodeWorker, rid: str, prompt: list[int]):
    """Places the request as the router does and steps both workers to its end: its tokens, their
    log-probabilities, its cached tokens and the pages d held of it."""
    reservation = d.add_request(DecodeRequest(rid, prompt, PARAMS, "p0"))
    p.submit(
        PrefillRequest(
            rid, prompt, PARAMS, 0, "d0", reservation.transfer_id, reservation.dest_cuts,
            reservation.num_held_pages,
        )
    )  # fmt: skip
    tokens, logprobs, cached = [], [], None
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"{rid} did not finish"
        p.step()
        d.step()
        outs = d.poll_outputs()
        for out in outs:
            assert out.error is None, out.error
            tokens += out.token_ids
            logprobs += out.logprobs
            cached = out.num_cached_tokens if cached is None else cached
        if any(out.finish_reason is not None for out in outs):
            return tokens, logprobs, cached, reservation.num_held_pages


def turns(model, caching: bool, prompts: list[list[int]]):
    """The prompts one after the other on one prefill and one decode worker (chunks of 8 tokens); per prompt
    what `serve` returns (a prompt None: the first one, its answer and `NEXT`), and p0's pages sent and
    not sent."""
    hub = LoopbackHub()
    with kernels.use_batch_invariant():
        d = DecodeWorker(
            "d0", model,
            DecodeConfig(page_size=PAGE, num_pages=48, max_prefill_chunk=CHUNK,
                         enable_prefix_caching=caching),
            make_receiver=lambda cache: LoopbackReceiver(hub, "d0", cache),
        )  # fmt: skip
        p = PrefillWorker(
            "p0", model,
            PrefillConfig(page_size=PAGE, num_pages=48, max_prefill_chunk=CHUNK,
                          enable_prefix_caching=caching),
            LoopbackSender(hub),
        )  # fmt: skip
        try:
            got = []
            for i, prompt in enumerate(prompts):
                prompt = prompt or [*prompts[0], *got[0][0], *NEXT]
                got.append(serve(p, d, f"r{i}", prompt))
            deadline = time.monotonic() + 10
            while p.stats().pages_used:  # its last acknowledgement
                assert time.monotonic() < deadline
                time.sleep(0.001)
            stats = p.stats()
            assert d.stats().pages_used == 0
        finally:
            p.close()
            d.close()
    return got, (stats.kv_pages_sent, stats.kv_pages_not_sent)


FIRST = prompt_ids(17, 0)
"""Chunks of 8, 8 and 1 tokens."""
NEXT = prompt_ids(6, 1)
"""The next turn's new tokens: with the first prompt and its 2-token answer, 25 tokens (7 pages)."""


def test_the_next_turn_travels_only_its_missing_pages_and_gives_the_bits_of_no_cache(
    reference_model,
):
    (one, two), pages = turns(reference_model, True, [FIRST, None])
    # d0 held the first prompt's 4 full pages; p0 found them too and computed from token 16
    assert (one[3], two[3], two[2]) == (0, 4, 16)
    assert pages == (5 + 3, 4)
    (want,), want_pages = turns(reference_model, False, [[*FIRST, *one[0], *NEXT]])
    assert want_pages == (7, 0) and (want[2], want[3]) == (0, 0)
    assert two[0] == want[0]
    for a, b in zip(two[1], want[1], strict=True):
        assert a.top_ids == b.top_ids
        assert torch.equal(torch.tensor(a.logprob), torch.tensor(b.logprob))
