# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""mla_decode (bf16 cache, 128 heads, page 64) at small batches: the tuned config (Gluon split kernel, 64 heads a
program) against other layouts / head blocks, each at the policy's split count and at forced ones. CUDA graph of
20 calls, median of 15 replays, us per call; the best five per (B, ctx). usage: sweep_mla_small.py [B,..] [CTX,..]"""

import sys

from sweep_split import PAGE, L, inputs, timed

from pdserve.kernels.mla_decode import triton as tri

CONFIGS = {
    "tuned": {},
    "hm64": {"gluon": False},
    "hm32": {"gluon": False, "BLOCK_M": 32, "num_warps": 4},
    "hm16": {"gluon": False, "BLOCK_M": 16, "num_warps": 4},
    "hm16n32": {"gluon": False, "BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4},
    "kv16": {"LAYOUT": "kv_major", "BLOCK_M": 16, "num_warps": 4, "gluon": False},
    "kv32": {"LAYOUT": "kv_major", "BLOCK_M": 32, "num_warps": 8, "gluon": False},
}
BS = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4]
CTXS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024, 4096]
for B in BS:
    for ctx in CTXS:
        per = ctx // PAGE
        q, cache, pt, sl = inputs(B, ctx)
        ref_out = tri.mla_decode_launch(q, cache, pt, sl, 0.07, L)[0].float()
        results = []
        for name, cfg in CONFIGS.items():
            for ns in (None, 4, 8, 16, 32, 64):
                if ns is not None and ns > per:
                    continue
                try:
                    out = tri.mla_decode_launch(
                        q, cache, pt, sl, 0.07, L, num_splits=ns, config=cfg
                    )[0]
                    err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
                    t = timed(
                        lambda: tri.mla_decode_launch(
                            q, cache, pt, sl, 0.07, L, num_splits=ns, config=cfg
                        )
                    )
                    results.append((t, f"{name} s{ns or 'P'}{'!' if err > 1e-2 else ''}"))
                except Exception as e:  # noqa: BLE001
                    results.append((1e9, f"{name} s{ns}: {type(e).__name__}"))
        tuned = next(t for t, n in results if n == "tuned sP")
        results.sort()
        print(
            f"B={B} ctx={ctx}: tuned {tuned:.1f} | "
            + "; ".join(f"{n} {t:.1f}" for t, n in results[:6]),
            flush=True,
        )
