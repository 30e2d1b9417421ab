"""fp8_gemm on DeepSeek-V3 shapes: 8192^3 against cuBLAS's blockwise `F.scaled_mm` (1x128 activation
groups, 128x128 weight blocks), and the decode projections (M = 64) by weight bandwidth.

Rows: "triton gemm" / "triton scaled_gemm" is the GEMM on pre-quantized activations (what scaled_mm
does, and what the model calls where the input's producer quantizes it, see PREQUANTIZED); "triton
fp8_gemm" includes the activation quantization (what the model calls for the other projections).
GB/s counts the fp8 weight and its scales once; TFLOP/s is 2*M*N*K over the time.

Decode shapes are timed three ways, each side the same way: plain launches; one call replayed from
a CUDA graph; and per call ("graph of 8"), a graph of BACK_TO_BACK calls on as many distinct
weights (no weight is read twice, so L2 holds none of them), which is how a decode step's graph
runs its projections one after another. A graph replay costs about 2 us on top of its kernels (quantize_act on one row:
6.1 us alone, 4.2 us a call in a graph of 8; H200), which the one-call row counts in full.

"plain read (floor)" rows time, per decode shape and the same graph-of-8 way, a kernel that only reads
the weight's bytes (the best of 1056 and 2112 programs): what a kernel streaming that weight can reach
at all, the launch and the ramp of a short kernel included. "plain read, PDL" does the same with
programmatic dependent launch, as the decode GEMMs run where `_backend.pdl_enabled` (sm_90+): each
read starts while the one before it finishes, so the launch and ramp overlap the previous call.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from _bench import FP8_FLOPS, HBM_BYTES_PER_S, Row, time_graph_ms, time_ms
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pdserve.kernels._backend import pdl_enabled
from pdserve.kernels.fp8_gemm import ref
from pdserve.kernels.fp8_gemm import triton as tri
from pdserve.kernels.fp8_quant_triton import quantize_rows

# name: (K, N) of DeepSeek-V3's projections as the model runs them (x @ W^T with W [N, K]). Projections of
# one input are stacked (model/deepseek.py's StackedLinear): qkv_a = q_a (1536) + kv_a (576), mlp_w13 = w1 + w3,
# shared_w13 = the shared expert's w1 + w3.
DECODE_SHAPES = {
    "qkv_a": (7168, 2112),
    "q_b": (1536, 24576),
    "kv_b": (512, 32768),
    "o": (16384, 7168),
    "mlp_w13": (7168, 36864),
    "mlp_w2": (18432, 7168),
    "shared_w13": (7168, 4096),
    "shared_w2": (2048, 7168),
}
PREQUANTIZED = {
    "qkv_a": 1, "q_b": 1, "mlp_w13": 1, "mlp_w2": 1, "shared_w13": 1, "shared_w2": 1, "o": 2,
}  # fmt: skip
"""Name -> the fewest rows from which, in an fp8 model, the input comes quantized from its producer
(`rmsnorm` / `silu_mul` / `head_matmul` with quant=True; an MoE layer's norm with quant="both" for
shared_w13): the model calls the GEMM alone (`scaled_gemm`). kv_b quantizes its input itself, and so
does o at one row."""


BACK_TO_BACK = 8


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
    rows = _square_rows()
    shapes = ["q_b", "qkv_a", "o", "mlp_w13"] if quick else list(DECODE_SHAPES)
    for m in (1, 64) if not quick else (64,):
        for name in shapes:
            rows += _decode_rows(name, m)
    rows += [_read_floor_row(name) for name in shapes]
    if pdl_enabled(torch.device("cuda", torch.cuda.current_device())):
        rows += [_read_floor_row(name, pdl=True) for name in shapes]
    return rows


def _square_rows() -> list[Row]:
    rows = []
    m = n = k = 8192
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_fp8, w_s = _weight(n, k)
    x_fp8, x_s = quantize_rows(x, 128, scale_column_major=True)
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
    return rows


class _Calls(list):
    """Calls run one after another by calling the list."""

    def __call__(self) -> None:
        for call in self:
            call()


def _back_to_back_ms(calls: _Calls) -> float:
    """Per-call milliseconds of `calls` captured one after another in one CUDA graph."""
    return time_graph_ms(calls) / len(calls)


def _decode_rows(name: str, m: int) -> list[Row]:
    k, n = DECODE_SHAPES[name]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights = [_weight(n, k) for _ in range(BACK_TO_BACK)]
    x_fp8, x_s = quantize_rows(x, 128, scale_column_major=True)
    weight_bytes = n * k + weights[0][1].numel() * 4
    if m >= PREQUANTIZED.get(name, m + 1):
        what = "triton scaled_gemm (fp8 input"
        ours = _Calls(functools.partial(tri.scaled_gemm, x_fp8, x_s, w, s) for w, s in weights)
    else:
        what = "triton fp8_gemm (+quant"
        ours = _Calls(functools.partial(tri.fp8_gemm, x, w, s) for w, s in weights)

    def peers() -> _Calls:
        return _Calls(_cublas_blockwise(x_fp8, x_s, w, s) for w, s in weights)

    rows = []
    timings = (("", time_ms), (", graph", time_graph_ms), (f", graph of {BACK_TO_BACK}", None))
    for how, timer in timings:
        if timer is None:  # per call, back to back on distinct weights
            peer, peer_ms = _peer_ms(peers, _back_to_back_ms)
            ms = _back_to_back_ms(ours)
        else:
            peer, peer_ms = _peer_ms(lambda: peers()[0], timer)
            ms = timer(ours[0])
        gbps = weight_bytes / ms / 1e6
        rows.append(
            Row("fp8_gemm", f"{name} M={m} {k}->{n}", f"{what}{how})", ms,
                gbps=gbps, ceiling_frac=gbps * 1e9 / HBM_BYTES_PER_S, peer=peer, peer_ms=peer_ms)
        )  # fmt: skip
    return rows


@triton.jit
def _read_kernel(w_ptr, out_ptr, n_bytes, per_program, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Reads per_program bytes from program_id * per_program and stores their sum (so that the loads
    stay). PDL: lets the next read launch at once, and waits for the previous one before the store."""
    if PDL:
        gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * per_program + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(w_ptr + i + offs, mask=i + offs < n_bytes, other=0).to(tl.int32)
    if PDL:
        gdc_wait()
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def _read_floor_row(name: str, pdl: bool = False) -> Row:
    k, n = DECODE_SHAPES[name]
    weights = [_weight(n, k) for _ in range(BACK_TO_BACK)]
    weight_bytes = n * k + weights[0][1].numel() * 4
    best = float("inf")
    for programs in (1056, 2112):
        block = 4096
        out = torch.empty(programs, dtype=torch.int32, device="cuda")
        calls = _Calls()
        for w, _ in weights:
            flat = w.view(torch.uint8).reshape(-1)
            per = triton.cdiv(triton.cdiv(flat.numel(), programs), block) * block
            calls.append(
                functools.partial(
                    _read_kernel[(programs,)],
                    flat,
                    out,
                    flat.numel(),
                    per,
                    BLOCK=block,
                    PDL=pdl,
                    launch_pdl=pdl,
                )
            )
        best = min(best, _back_to_back_ms(calls))
    gbps = weight_bytes / best / 1e6
    how = "plain read, PDL" if pdl else "plain read (floor)"
    return Row("fp8_gemm", f"{name} {k}->{n}", f"{how}, graph of {BACK_TO_BACK}", best,
               gbps=gbps, ceiling_frac=gbps * 1e9 / HBM_BYTES_PER_S)  # fmt: skip
