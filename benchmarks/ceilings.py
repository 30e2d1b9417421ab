"""The ceilings the kernel tables divide by, measured on this GPU:  python benchmarks/ceilings.py

HBM: a 1 GiB device-to-device copy, bytes read + written over the time. bf16: cuBLAS's 8192^3 GEMM. fp8:
`torch._scaled_mm` at 8192^3 with per-tensor scales. `_bench.py`'s HBM_BYTES_PER_S, BF16_FLOPS and FP8_FLOPS
are this script's figures on an H200; on other hardware the kernel tables' fractions are of those."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import BF16_FLOPS, FP8_FLOPS, HBM_BYTES_PER_S, time_ms  # noqa: E402

COPY_BYTES = 1 << 30
GEMM = 8192


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    hbm = 2 * COPY_BYTES / (time_ms(lambda: dst.copy_(src)) * 1e-3)

    flops = 2 * GEMM**3
    a = torch.randn(GEMM, GEMM, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(GEMM, GEMM, dtype=torch.bfloat16, device="cuda")
    bf16 = flops / (time_ms(lambda: a @ b) * 1e-3)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32, device="cuda")
    # cuBLAS's fp8 GEMM takes its second operand column-major: a transposed view
    fp8 = flops / (
        time_ms(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16)) * 1e-3
    )

    print(torch.cuda.get_device_name())
    for name, value, unit, used in (
        ("HBM device copy (read + written)", hbm / 1e12, "TB/s", HBM_BYTES_PER_S / 1e12),
        (f"bf16 GEMM {GEMM}^3 (cuBLAS)", bf16 / 1e12, "TFLOP/s", BF16_FLOPS / 1e12),
        (f"fp8 GEMM {GEMM}^3, per-tensor scales", fp8 / 1e12, "TFLOP/s", FP8_FLOPS / 1e12),
    ):
        print(f"{name:>38}: {value:7.2f} {unit}  (the tables use {used:.2f})")


if __name__ == "__main__":
    main()
