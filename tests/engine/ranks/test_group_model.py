"""A rank group of 2 CPU processes (the driver and one rank, gloo) running the tiny model sharded by a
`ParallelLayout`, driven only by the driver's step messages (per-rank token ids, positions and pages): a prefill
step, then a decode step fed the greedy tokens the prefill replies carried. Logits equal the single-process path's
within 1e-5 relative and the greedy tokens are the same, for DP2 + EP2 (different requests per rank, one rank idle
in the decode step) and TP2 (the same requests on both ranks)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.ranks.group import RankGroup, RankGroupConfig
from pdserve.engine.ranks.process import HandlerSpec
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint

from . import _rank_handlers
from ._rank_handlers import PAGE_SIZE

# its tests start processes of their own
pytestmark = pytest.mark.subprocess

PROMPT_LENS = (5, 19, 33)
NUM_PAGES = 8 * len(PROMPT_LENS)


def pages_of(request: int, prompt_len: int) -> list[int]:
    return list(range(request * 8, request * 8 + -(-(prompt_len + 1) // PAGE_SIZE)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(
        tmp_path_factory.mktemp("ck") / "tiny", "tiny", dtype="fp32", progress=False
    )


@pytest.fixture(scope="module")
def prompts(tiny):
    vocab = load_model(tiny, dtype=torch.float32, use_mtp=False, progress=False).args.vocab_size
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(tiny, prompts):
    """Single process, all requests in one batch: prefill logits, then decode logits of each request fed its
    own greedy token."""
    model = load_model(tiny, dtype=torch.float32, use_mtp=False, progress=False)
    layout = KVCacheLayout.for_model(model.args, PAGE_SIZE, torch.float32, model.num_mtp)
    cache = PagedKVCache(layout, NUM_PAGES, "cpu")
    out = {}
    with torch.inference_mode():
        for step in ("prefill", "decode"):
            chunks = [
                SeqChunk(p, 0, pages_of(i, len(p))) if step == "prefill"
                else SeqChunk([int(out["prefill"][i].argmax())], len(p), pages_of(i, len(p)))
                for i, p in enumerate(prompts)
            ]  # fmt: skip
            batch = build_forward_batch(chunks, PAGE_SIZE, "cpu", decode=step == "decode")
            out[step] = model.compute_logits(model(batch, cache)[batch.logits_indices])
    return out


LAYOUTS = {
    "dp2-ep2": ({"attention": "data", "expert_parallel": 2}, [[0, 2], [1]], {0, 2}),
    "tp2": ({"attention": "tensor", "dense": "tensor"}, [[0, 1, 2], [0, 1, 2]], {0, 1, 2}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_driver_steps_equal_single_process(name, tiny, prompts, reference):
    layout, by_rank, decoding = LAYOUTS[name]
    handler = HandlerSpec(
        f"{_rank_handlers.__name__}:model_step",
        {"ckpt": str(tiny), "layout": layout, "num_pages": NUM_PAGES},
    )
    config = RankGroupConfig(2, channel="shm", join_timeout_s=180.0, step_timeout_s=120.0)
    with RankGroup(config, handler) as group:
        prefill = group.step({
            "decode": False,
            "chunks": [
                [{"request": i, "tokens": prompts[i], "start": 0,
                  "pages": pages_of(i, len(prompts[i]))} for i in mine]
                for mine in by_rank
            ],
        })  # fmt: skip
        greedy = {i: tok for reply in prefill for i, (_, tok) in reply.items()}
        decode = group.step({
            "decode": True,
            "chunks": [
                [{"request": i, "tokens": [greedy[i]], "start": len(prompts[i]),
                  "pages": pages_of(i, len(prompts[i]))} for i in mine if i in decoding]
                for mine in by_rank
            ],
        })  # fmt: skip
    for step, replies in (("prefill", prefill), ("decode", decode)):
        for rank, (reply, mine) in enumerate(zip(replies, by_rank, strict=True)):
            want = {i for i in mine if step == "prefill" or i in decoding}
            assert set(reply) == want, f"{name} rank {rank} {step}"
            for i, (logits_bytes, token) in reply.items():
                got = torch.frombuffer(bytearray(logits_bytes), dtype=torch.float32)
                expected = reference[step][i]
                err = ((got - expected).abs().max() / expected.abs().max()).item()
                assert err <= 1e-5, f"{name} rank {rank} {step} request {i}: {err:.2e}"
                assert token == int(expected.argmax()), f"{name} rank {rank} {step} request {i}"
