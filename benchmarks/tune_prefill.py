"""Launch-config sweeps for the prefill-side kernels (mla_prefill, sampling, moe_route) on one GPU:
python benchmarks/tune_prefill.py [--ops mla_prefill,sampling,moe_route]

Each candidate is registered into `kernels.tuning` for this process only, timed on the shapes that
matter, and printed; the winners are then written into kernels/tuning.py by hand."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import time_ms  # noqa: E402

from pdserve.kernels import tuning  # noqa: E402

ARCH = "sm90"


def tune_mla_prefill() -> None:
    from bench_mla_prefill import _flops, time_triton

    # BLOCK_M, BLOCK_N, warps, stages, tma: the tuned entry (128/64/8/3, TMA), the pointer-load
    # entry it replaced and its nearest rivals, 1-25% slower than it on an H200 at 8 x 4096
    configs = [
        (128, 128, 8, 2, False), (128, 64, 8, 3, True), (128, 128, 8, 2, True),
        (128, 64, 8, 2, True), (64, 64, 4, 3, True),
    ]  # fmt: skip
    shapes = [([4096] * 8, [4096] * 8, 128, True), ([4096] * 8, [4096] * 8, 16, True)]
    for bm, bn, warps, stages, tma in configs:
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "tma": tma}
        tuning.register("mla_prefill", ARCH, {"default": cfg})
        cells = []
        for q_lens, k_lens, heads, causal in shapes:
            try:
                ms = time_triton(q_lens, k_lens, heads, causal)
                tflops = _flops(q_lens, k_lens, heads, causal) / ms / 1e9
                cells.append(f"{ms:8.3f} ms {tflops:5.0f} TF")
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped
                cells.append(f"failed: {type(exc).__name__}: {str(exc)[:60]}")
        label = f"BM={bm} BN={bn} w={warps} s={stages} tma={tma}"
        print(f"mla_prefill {label}: " + " | ".join(cells), flush=True)


def tune_sampling() -> None:
    from bench_sampling import MIXED, NO_SORT, _args

    from pdserve.kernels.sampling import triton as tri

    for block, warps, per_sm in [(1024, 4, 4), (2048, 8, 4), (4096, 8, 4), (2048, 4, 8)]:
        cfg = {"BLOCK": block, "THRESHOLD_BLOCK": 2048, "programs_per_sm": per_sm,
               "num_warps": warps}  # fmt: skip
        tuning.register("sampling", ARCH, {"default": cfg})
        cells = []
        for batch, kinds in ((1, NO_SORT), (256, NO_SORT), (256, MIXED)):
            args = _args(batch, kinds)
            cells.append(f"b{batch}: {time_ms(lambda: tri.sample(*args)):.4f} ms")  # noqa: B023
        print(f"sampling BLOCK={block} w={warps} per_sm={per_sm}: " + " | ".join(cells), flush=True)


def tune_moe_route() -> None:
    from pdserve.kernels.moe_route import triton as tri

    for block_t, warps in [(4, 4), (16, 4), (32, 4), (64, 8)]:
        tuning.register("moe_route", ARCH, {"default": {"BLOCK_T": block_t, "num_warps": warps}})
        cells = []
        for experts, groups, kept, top_k in ((256, 8, 4, 8), (64, 1, 1, 6)):
            for tokens in (64, 8192):
                logits = torch.randn(tokens, experts, device="cuda")
                bias = torch.randn(experts, device="cuda")
                ms = time_ms(lambda: tri.moe_route(logits, bias, top_k, groups, kept, 2.5, True))  # noqa: B023
                cells.append(f"e{experts} t{tokens}: {ms * 1e3:.1f} us")
        print(f"moe_route BLOCK_T={block_t} w={warps}: " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", default="mla_prefill,sampling,moe_route")
    args = parser.parse_args()
    for op in args.ops.split(","):
        {"mla_prefill": tune_mla_prefill, "sampling": tune_sampling, "moe_route": tune_moe_route}[
            op
        ]()


if __name__ == "__main__":
    main()
