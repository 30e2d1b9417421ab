"""fp8_gemm on DeepSeek-V3 shapes: 8192^3 against cuBLAS's blockwise `F.scaled_mm` (1x128 activation
groups, 128x128 weight blocks), and the decode projections (M = 64) by weight bandwidth.

Rows: "triton gemm" is the GEMM on pre-quantized activations (what scaled_mm does); "triton
fp8_gemm" includes the activation quantization (what the model calls). GB/s counts the fp8 weight
and its scales once; TFLOP/s is 2*M*N*K over the time.
"""

from __future__ import annotations

import torch
from _bench import FP8_FLOPS, HBM_BYTES_PER_S, Row, time_graph_ms, time_ms

from pdserve.kernels.fp8_gemm import ref
from pdserve.kernels.fp8_gemm import triton as tri

# name: (K, N) of DeepSeek-V3's projections (x @ W^T with W [N, K])
DECODE_SHAPES = {
    "q_a": (7168, 1536),
    "q_b": (1536, 24576),
    "kv_a": (7168, 576),
    "kv_b": (512, 32768),
    "o": (16384, 7168),
    "mlp_w1": (7168, 18432),
    "mlp_w2": (18432, 7168),
    "shared_w1": (7168, 2048),
}


def _weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device="cuda") * 0.02
    return ref.quantize_weight(w)


def _cublas_blockwise(x_fp8, x_scales_cm, w_fp8, w_scale_inv):
    """cuBLAS blockwise fp8 GEMM through torch: activation scales [M, K/128] and weight scales
    [K/128, N/128], both column-major; mat_b column-major ([K, N] view of [N, K])."""
    F = torch.nn.functional
    return lambda: F.scaled_mm(
        x_fp8, w_fp8.t(), x_scales_cm, F.ScalingType.BlockWise1x128,
        w_scale_inv.t(), F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16,
    )  # fmt: skip


def _peer_ms(make, timer=time_ms) -> tuple[str, float | None]:
    try:
        fn = make()
        fn()
        return "cuBLAS scaled_mm blockwise", timer(fn)
    except (RuntimeError, NotImplementedError, AttributeError) as err:  # peer unsupported here
        return f"scaled_mm failed: {str(err).splitlines()[0][:60]}", None


def run(quick: bool) -> list[Row]:
    rows = []
    m = n = k = 8192
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_fp8, w_s = _weight(n, k)
    x_fp8, x_s = tri._quantize(x, 128, scale_column_major=True)
    peer, peer_ms = _peer_ms(lambda: _cublas_blockwise(x_fp8, x_s, w_fp8, w_s))
    flops = 2 * m * n * k
    ms = time_ms(lambda: tri.scaled_gemm(x_fp8, x_s, w_fp8, w_s))
    rows.append(
        Row("fp8_gemm", "8192^3", "triton gemm", ms, tflops=flops / ms / 1e9,
            ceiling_frac=flops / ms / 1e9 / (FP8_FLOPS / 1e12), peer=peer, peer_ms=peer_ms)
    )  # fmt: skip
    ms = time_ms(lambda: tri.fp8_gemm(x, w_fp8, w_s))
    rows.append(
        Row("fp8_gemm", "8192^3", "triton fp8_gemm (+quant)", ms, tflops=flops / ms / 1e9,
            ceiling_frac=flops / ms / 1e9 / (FP8_FLOPS / 1e12), peer=peer, peer_ms=peer_ms)
    )  # fmt: skip
    del x, w_fp8, w_s, x_fp8, x_s

    shapes = ["q_b", "kv_a", "o", "mlp_w1"] if quick else list(DECODE_SHAPES)
    for m in (1, 64) if not quick else (64,):
        for name in shapes:
            k, n = DECODE_SHAPES[name]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w_fp8, w_s = _weight(n, k)
            x_fp8, x_s = tri._quantize(x, 128, scale_column_major=True)
            weight_bytes = n * k + w_s.numel() * 4
            # Plain launches, then replayed from a CUDA graph as the decode step runs them (both sides).
            for timer, how in ((time_ms, ""), (time_graph_ms, ", graph")):
                peer, peer_ms = _peer_ms(
                    lambda: _cublas_blockwise(x_fp8, x_s, w_fp8, w_s),  # noqa: B023
                    timer,
                )
                ms = timer(lambda: tri.fp8_gemm(x, w_fp8, w_s))  # noqa: B023
                gbps = weight_bytes / ms / 1e6
                rows.append(
                    Row("fp8_gemm", f"{name} M={m} {k}->{n}", f"triton fp8_gemm (+quant{how})",
                        ms, gbps=gbps, ceiling_frac=gbps * 1e9 / HBM_BYTES_PER_S, peer=peer,
                        peer_ms=peer_ms)
                )  # fmt: skip
    return rows
