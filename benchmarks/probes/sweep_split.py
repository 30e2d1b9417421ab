# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""mla_decode (bf16 cache, 128 heads, page 64): the policy's split count against forced ones, at small batches.
CUDA graph of 20 calls, median of 15 replays, us per call. usage: sweep_split.py [B,B...] [CTX,CTX...]"""

import sys

import torch
from _common import graph_us

from pdserve.kernels._backend import num_sms
from pdserve.kernels.mla_decode import triton as tri

H, L, R, PAGE = 128, 512, 64, 64


timed = graph_us  # sweep_mla_small takes it from here


def inputs(B: int, ctx: int):
    """(q [B, 1, H, L + R], a bf16 cache of B * ctx / PAGE pages, its shuffled page table, seq_lens)."""
    per = ctx // PAGE
    cache = torch.randn(B * per, PAGE, L + R, device="cuda", dtype=torch.bfloat16)
    pt = torch.randperm(B * per, device="cuda", dtype=torch.int32).view(B, per)
    sl = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    return torch.randn(B, 1, H, L + R, device="cuda", dtype=torch.bfloat16), cache, pt, sl


def main() -> None:
    BS = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4, 16]
    CTXS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024, 4096]
    for B in BS:
        for ctx in CTXS:
            per = ctx // PAGE
            q, cache, pt, sl = inputs(B, ctx)
            base = timed(lambda: tri.mla_decode_launch(q, cache, pt, sl, 0.07, L))
            ref_out = tri.mla_decode_launch(q, cache, pt, sl, 0.07, L)[0]
            cfg = tri.tuning.lookup("mla_decode", "bf16,m64", q.device)
            chosen = tri.choose_num_splits(B, 2, per * PAGE, cfg["BLOCK_N"], cfg, num_sms(q.device))
            row = [f"B={B:3d} ctx={ctx:5d} policy(s{chosen}) {base:6.1f}"]
            for ns in (1, 2, 4, 8, 16, 32, 64):
                if ns > per:
                    break
                out = tri.mla_decode_launch(q, cache, pt, sl, 0.07, L, num_splits=ns)[0]
                err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
                t = timed(
                    lambda ns=ns: tri.mla_decode_launch(q, cache, pt, sl, 0.07, L, num_splits=ns)
                )
                row.append(f"s{ns} {t:6.1f}{'!' if err > 1e-2 else ''}")
            print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
