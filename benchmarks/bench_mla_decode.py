"""MLA decode (absorbed, paged latent cache) on DeepSeek-V3 shapes: kv_lora 512 + rope 64, 16 heads
(TP8) and 128 heads (TP1), batches 1-256, cache lengths 1K-32K, bf16 and fp8 caches, page size 64.

Bytes are the cache bytes read once (the q and out bytes add under 1%); FLOPs are
2 * B * Q * H * L * (576 + 512). The row's ceiling fraction is the roofline floor (the larger of
bytes / 4.27 TB/s and FLOPs / 797 TFLOP/s) over the measured time. Every request has the full
length; pages are a random permutation of the pool. The peer is torch on a contiguous copy of the
same cache (bmm, softmax, bmm; no paging), only where its scores fit in memory."""

from __future__ import annotations

import math

import torch
from _bench import BF16_FLOPS, HBM_BYTES_PER_S, Row, time_graph_ms, time_ms

from pdserve.kernels.mla_decode import fp8_format, ref
from pdserve.kernels.mla_decode import triton as tri

LORA, ROPE = 512, 64
SCALE = 192**-0.5


def make_inputs(
    batch: int,
    heads: int,
    num_q: int,
    seq_len: int,
    page_size: int,
    fp8: bool,
    seed: int = 0,
    shuffle: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, Q, H, 576] bf16, cache (bf16 or fp8 rows), page_table (pages shuffled over the pool
    unless `shuffle` is False: then each request's pages are back to back), seq_lens."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_req = -(-seq_len // page_size)
    num_pages = batch * pages_per_req
    rows = num_pages * page_size
    kv = torch.randn(rows, LORA + ROPE, device="cuda", generator=gen, dtype=torch.bfloat16)
    if fp8:
        cache = ref.quantize_kv_fp8(kv[:, :LORA], kv[:, LORA:]).view(num_pages, page_size, -1)
    else:
        cache = kv.view(num_pages, page_size, LORA + ROPE)
    perm = torch.randperm(num_pages, device="cuda", generator=gen).int()
    if not shuffle:
        perm = torch.arange(num_pages, device="cuda", dtype=torch.int32)
    page_table = perm.view(batch, pages_per_req)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, num_q, heads, LORA + ROPE, device="cuda", generator=gen).bfloat16()
    return q, cache, page_table, seq_lens


def row_bytes(fp8: bool) -> int:
    return fp8_format.row_bytes(LORA, ROPE) if fp8 else (LORA + ROPE) * 2


def make_row(shape: str, impl: str, ms: float, batch, heads, num_q, seq_len, fp8) -> Row:
    nbytes = batch * seq_len * row_bytes(fp8)
    flops = 2 * batch * num_q * heads * seq_len * (2 * LORA + ROPE)
    floor_ms = 1e3 * max(nbytes / HBM_BYTES_PER_S, flops / BF16_FLOPS)
    return Row(
        "mla_decode", shape, impl, ms, gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9,
        ceiling_frac=floor_ms / ms,
    )  # fmt: skip


def _torch_peer(q: torch.Tensor, kv: torch.Tensor):
    """Contiguous-cache torch attention: q [B, Q, H, 576], kv [B, L, 576] bf16."""
    batch, num_q, heads, dk = q.shape
    qf = q.view(batch, num_q * heads, dk)
    scores = torch.bmm(qf, kv.transpose(1, 2)).float() * SCALE  # [B, QH, L]
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.bmm(probs, kv[..., :LORA])  # [B, QH, 512]


SHAPES = [
    # batch, heads, queries, cache length, fp8
    (128, 16, 1, 4096, False),
    (128, 16, 1, 8192, False),
    (128, 128, 1, 4096, False),
    (128, 128, 1, 8192, False),
    (128, 16, 1, 4096, True),
    (128, 16, 1, 8192, True),
    (128, 128, 1, 4096, True),
    (128, 128, 1, 8192, True),
    (1, 16, 1, 32768, False),
    (1, 128, 1, 32768, False),
    (32, 16, 1, 8192, False),
    (256, 16, 1, 1024, False),
    (256, 128, 1, 1024, False),
    (64, 16, 4, 4096, False),
    (64, 128, 2, 4096, False),
    (1, 16, 1, 32768, True),
    (256, 16, 1, 1024, True),
]
QUICK = [0, 1, 2, 3, 4, 6]


def run(quick: bool) -> list[Row]:
    rows = []
    for i, (batch, heads, num_q, seq_len, fp8) in enumerate(SHAPES):
        if quick and i not in QUICK:
            continue
        q, cache, page_table, seq_lens = make_inputs(batch, heads, num_q, seq_len, 64, fp8)
        shape = f"B={batch} H={heads} Q={num_q} L={seq_len} {'fp8' if fp8 else 'bf16'} p64"
        args = (q, cache, page_table, seq_lens, SCALE, LORA)
        # small batches also replayed from a CUDA graph, as the decode step runs them: plain
        # launches of a 30-60 us call measure the host's launch latency as much as the kernels
        timers = [("triton", time_ms)] + ([("triton, graph", time_graph_ms)] if batch <= 4 else [])
        score_bytes = batch * num_q * heads * seq_len * 4
        kv = None
        if not fp8 and score_bytes < (2 << 30) and math.prod(cache.shape) < (2 << 30):
            kv = cache[page_table.long()].view(batch, -1, LORA + ROPE)[:, :seq_len].contiguous()
        if heads * num_q >= 64:
            # the Triton heads_major kernel that the Gluon one (gluon_sm90) replaces on sm_90
            timers.append(("tl.dot kernel", time_ms))
        for impl, timer in timers:
            config = {"gluon": False} if impl == "tl.dot kernel" else None
            ms = timer(lambda args=args, c=config: tri.mla_decode_launch(*args, None, c))
            row = make_row(shape, impl, ms, batch, heads, num_q, seq_len, fp8)
            if kv is not None and config is None:
                row.peer = "torch bmm" + (", graph" if timer is time_graph_ms else "")
                row.peer_ms = timer(lambda q=q, kv=kv: _torch_peer(q, kv))
            rows.append(row)
        del kv
        del q, cache
        torch.cuda.empty_cache()
    return rows
