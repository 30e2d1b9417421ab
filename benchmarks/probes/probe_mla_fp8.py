# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""mla_decode on an fp8 cache at 64+ query rows (128 heads): the Gluon split kernel's variants (tile positions n,
ring stages s) against the Triton fp8 kernel and the bf16 cache's Gluon kernel. First each variant's
error against the torch reference on ragged shapes (partial tiles, splits, MTP, page 16 / 64), then the time
(`_bench.time_ms`: L2 flushed, median of 50) at B=128, kv 4096 / 8192 (issue 3's shapes), with TFLOP/s.
usage: probe_mla_fp8.py [variant,..] (default: all)"""

import sys

sys.path.insert(0, "benchmarks")

import torch
from _bench import time_ms
from bench_mla_decode import LORA, ROPE, SCALE, make_inputs

from pdserve.kernels.mla_decode import ref
from pdserve.kernels.mla_decode import triton as tri

VARIANTS = {
    "triton": {"gluon": False},
    "n64s2": {"gluon": True, "BLOCK_N": 64, "gluon_stages": 2},
    "n32s3": {"gluon": True, "BLOCK_N": 32, "gluon_stages": 3},
    "n32s4": {"gluon": True, "BLOCK_N": 32, "gluon_stages": 4},
}
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)


def ragged(seq_lens, heads, num_q, page, seed):
    """q bf16, an fp8 cache with shuffled pages; the rows past each request and a spare page poisoned."""
    g = torch.Generator().manual_seed(seed)
    per = [max(1, -(-n // page)) for n in seq_lens]
    num_pages = sum(per) + 1
    order = torch.randperm(num_pages - 1, generator=g)
    pt = torch.full((len(seq_lens), max(per) + 1), num_pages - 1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(per):
        pt[b, :n] = order[at : at + n].int()
        at += n
    kv = torch.randn(num_pages * page, LORA + ROPE, generator=g)
    cache = ref.quantize_kv_fp8(kv[:, :LORA], kv[:, LORA:]).view(num_pages, page, -1)
    cache[-1] = 0x7F  # NaN in e4m3, huge in bf16 and fp32
    for b, n in enumerate(seq_lens):  # and the rows past each request's end in its last page
        if n % page:
            cache[pt[b, n // page], n % page :] = 0x7F
    q = torch.randn(len(seq_lens), num_q, heads, LORA + ROPE, generator=g).bfloat16()
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return q.cuda(), cache.cuda(), pt.cuda(), sl.cuda()


CHECKS = [
    ((1, 3000, 128, 999, 4097), 128, 1, 64),
    ((3, 2000, 517, 1025), 128, 2, 16),
    ((700, 2, 64, 1), 64, 1, 64),
]
print(
    "| variant | "
    + " | ".join(f"B{len(s)} H{h} Q{nq} p{p} s{ns}" for s, h, nq, p in CHECKS for ns in (None, 7))
    + " |"
)
for name in names:
    errs = []
    for seq_lens, heads, num_q, page in CHECKS:
        q, cache, pt, sl = ragged(seq_lens, heads, num_q, page, len(seq_lens))
        want_o, want_l = ref.mla_decode(q, cache, pt, sl, SCALE, LORA)
        for ns in (None, 7):
            try:
                o, lse = tri.mla_decode_launch(q, cache, pt, sl, SCALE, LORA, ns, VARIANTS[name])
                e = ((o.float() - want_o).norm() / want_o.norm()).item()
                le = (lse - want_l).abs().nan_to_num(1e9).max().item()
                errs.append(f"{e:.1e}/{le:.0e}")
            except Exception as ex:  # noqa: BLE001
                errs.append(f"{type(ex).__name__}: {str(ex)[:60]}")
    print(f"| {name} | " + " | ".join(errs) + " |", flush=True)

print("\n| variant | B | H | L | us | TFLOP/s | GB/s |")
for batch, heads, seq_len in ((128, 128, 4096), (128, 128, 8192), (32, 128, 8192), (4, 128, 4096)):
    q, cache, pt, sl = make_inputs(batch, heads, 1, seq_len, 64, True)
    flops = 2 * batch * heads * seq_len * (2 * LORA + ROPE)
    nbytes = batch * seq_len * cache.shape[-1]
    runs = [(n, VARIANTS[n], (q, cache, pt, sl)) for n in names]
    qb, cb, pb, sb = make_inputs(batch, heads, 1, seq_len, 64, False)
    runs.append(("bf16 cache", None, (qb, cb, pb, sb)))
    for name, cfg, (q_, c_, p_, s_) in runs:
        try:
            ms = time_ms(lambda: tri.mla_decode_launch(q_, c_, p_, s_, SCALE, LORA, None, cfg))
            print(
                f"| {name} | {batch} | {heads} | {seq_len} | {ms * 1e3:.1f} | {flops / ms / 1e9:.0f} | {nbytes / ms / 1e6:.0f} |",
                flush=True,
            )
        except Exception as ex:  # noqa: BLE001
            print(
                f"| {name} | {batch} | {heads} | {seq_len} | {type(ex).__name__}: {str(ex)[:80]} |",
                flush=True,
            )
    del qb, cb, q, cache
    torch.cuda.empty_cache()
