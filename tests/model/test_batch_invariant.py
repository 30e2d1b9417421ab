"""Batch-invariant mode: with the Triton kernels and `use_batch_invariant()`, a request's logits and KV
cache are bit-for-bit the same whichever requests share its forward pass, in whatever order, on
whichever cache pages, under whatever page-table width (the CUDA-graph buckets pad it). This is what
lets a server's outputs equal the offline path's on a GPU.

On CPU the kernels run in the Triton interpreter on the fp32 tiny model (the interpreter's bf16
`tl.dot` is wrong); on a GPU the bf16 tiny model, and the v2-lite-shape checkpoint when
$PDSERVE_V2LITE_DIR names one. The interpreter's `tl.dot` is numpy's matmul, whose summation order
depends on the row count on some CPUs (OpenBLAS's small-matrix kernels on AMD EPYC), so on CPU the
arrangements agree to fp32 rounding (which still catches a wrong page, slot or row) and the bit-for-bit
claim is the GPU's."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.kernels import use_backend, use_batch_invariant
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model

PAGE_SIZE = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-for-bit on a GPU; to fp32 rounding under the CPU interpreter (see the module docstring)."""
    if got.is_cuda:
        assert torch.equal(got, want), what
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=what)


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class Arrangement:
    """The requests `order` (indices into the prompts) on private cache pages laid out in its own way;
    prefill packs them into one forward pass, decode steps run them as one batch."""

    def __init__(self, model, prompts, order, reverse_pages: bool, spare_pages: int):
        self.model, self.prompts, self.order = model, prompts, order
        longest = max(len(p) for p in prompts) + 8
        per_seq = -(-longest // PAGE_SIZE) + spare_pages
        num_pages = per_seq * len(order) + 1
        layout = KVCacheLayout.for_model(model.args, PAGE_SIZE, model.dtype, model.num_mtp)
        self.cache = PagedKVCache(layout, num_pages, DEVICE)
        ids = list(range(1, num_pages))
        if reverse_pages:
            ids.reverse()
        self.pages = {i: ids[k * per_seq : (k + 1) * per_seq] for k, i in enumerate(order)}
        self.pos = {i: len(prompts[i]) for i in order}

    def prefill(self) -> dict[int, torch.Tensor]:
        chunks = [SeqChunk(self.prompts[i], 0, self.pages[i]) for i in self.order]
        return self._run(chunks, decode=False)

    def decode(self, tokens: dict[int, int]) -> dict[int, torch.Tensor]:
        chunks = [SeqChunk([tokens[i]], self.pos[i], self.pages[i]) for i in self.order]
        for i in self.order:
            self.pos[i] += 1
        return self._run(chunks, decode=True)

    def _run(self, chunks, decode: bool) -> dict[int, torch.Tensor]:
        batch = build_forward_batch(chunks, PAGE_SIZE, DEVICE, decode=decode)
        hidden = self.model(batch, self.cache)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return {i: logits[k] for k, i in enumerate(self.order)}

    def cache_rows(self, i: int) -> torch.Tensor:
        """The request's cache rows in position order, the last decode step's included:
        [layers, positions, D]."""
        pages = torch.tensor(self.pages[i], device=DEVICE)
        layers = range(self.model.args.num_hidden_layers)  # not the MTP layers: unused here
        layer_rows = [self.cache.layer(j)[pages].flatten(0, 1) for j in layers]
        return torch.stack(layer_rows)[:, : self.pos[i]]


def check_invariance(model, lengths: list[int], steps: int) -> None:
    prompts = _prompts(model.args.vocab_size, lengths)
    n = len(prompts)
    # against all requests in order: the last and the first alone together (other company, other offsets in the
    # packed prefill, another order), on pages in reverse, with a wider page table
    arrangements = [
        Arrangement(model, prompts, list(range(n)), reverse_pages=False, spare_pages=0),
        Arrangement(model, prompts, [n - 1, 0], reverse_pages=True, spare_pages=9),
    ]
    with use_backend("triton"), use_batch_invariant():
        outs = [a.prefill() for a in arrangements]
        for step in range(steps + 1):
            for a, out in zip(arrangements[1:], outs[1:], strict=True):
                for i in a.order:
                    _same(
                        out[i],
                        outs[0][i],
                        f"step {step}: request {i}'s logits differ in arrangement {a.order}",
                    )
            if step == steps:
                break
            tokens = {i: int(outs[0][i].argmax()) for i in range(n)}
            outs = [a.decode(tokens) for a in arrangements]
        for a in arrangements[1:]:
            for i in a.order:
                _same(a.cache_rows(i), arrangements[0].cache_rows(i), f"request {i}'s cache rows")


def test_tiny_model_is_batch_invariant(checkpoint) -> None:
    name = "tiny-bf16" if DEVICE == "cuda" else "tiny-fp32"
    model = load_model(checkpoint(name), device=DEVICE)
    # 19 tokens: two pages; one decode step: its logits read the prefill's rows, and the cache check
    # covers the rows both steps write
    check_invariance(model, [19, 5, 11], steps=1)


@pytest.mark.gpu
@pytest.mark.skipif(not os.environ.get("PDSERVE_V2LITE_DIR"), reason="needs $PDSERVE_V2LITE_DIR")
def test_v2_lite_shape_is_batch_invariant() -> None:
    model = load_model(os.environ["PDSERVE_V2LITE_DIR"], device=DEVICE)
    check_invariance(model, [700, 37, 300, 1, 129], steps=4)
