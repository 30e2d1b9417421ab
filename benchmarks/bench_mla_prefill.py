"""MLA prefill attention (q/k head 192, v head 128, bf16) on DeepSeek-V3 shapes: the Triton varlen
kernel against torch SDPA on the equivalent padded [B, H, L, D] batch.

FLOPs are counted as 2 * (192 + 128) * H * sum(Lq * Lk), halved for causal self-attention (the
masked half is not counted), and compared with the 797 TFLOP/s bf16 ceiling. SDPA runs with
whichever backend torch picks by default for these shapes (named in the peer column);
`sdpa_backends()` times every backend that accepts qk 192 / v 128."""

from __future__ import annotations

import torch
from _bench import BF16_FLOPS, Row, time_ms

HEAD_QK, HEAD_V = 192, 128


def _flops(q_lens: list[int], k_lens: list[int], heads: int, causal: bool) -> float:
    pairs = sum(lq * lk for lq, lk in zip(q_lens, k_lens, strict=True))
    return 2 * (HEAD_QK + HEAD_V) * heads * pairs / (2 if causal else 1)


def _varlen(q_lens: list[int], k_lens: list[int], heads: int):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(sum(q_lens), heads, HEAD_QK, device=dev, dtype=dt)
    k = torch.randn(sum(k_lens), heads, HEAD_QK, device=dev, dtype=dt)
    v = torch.randn(sum(k_lens), heads, HEAD_V, device=dev, dtype=dt)

    def cu(lens):
        offsets = [0, *torch.tensor(lens).cumsum(0).tolist()]
        return torch.tensor(offsets, device=dev, dtype=torch.int32)

    return q, k, v, cu(q_lens), cu(k_lens)


def sdpa_default_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """The backend torch's SDPA dispatcher picks here (a private API: 'unknown' if gone)."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, causal)).name
    except Exception as exc:  # noqa: BLE001 - private API, report rather than fail the benchmark
        return f"unknown ({type(exc).__name__})"


def sdpa_backends(batch: int, seq_len: int, heads: int) -> list[Row]:
    """Every SDPA backend that accepts qk 192 / v 128 on the padded causal shape, timed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch, heads, seq_len, HEAD_QK, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(batch, heads, seq_len, HEAD_V, device="cuda", dtype=torch.bfloat16)
    flops = _flops([seq_len] * batch, [seq_len] * batch, heads, True)
    rows = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):  # fmt: skip
        if backend == SDPBackend.MATH and batch * heads * seq_len > 2**20:
            continue  # materialises [B, H, L, L] scores: far too large here

        def fn():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        try:
            with sdpa_kernel([backend]):
                fn()
                torch.cuda.synchronize()
                ms = time_ms(fn, warmup=3, iters=10)
        except RuntimeError as exc:
            print(f"sdpa {backend.name}: rejected ({str(exc).splitlines()[0][:120]})")
            continue
        tflops = flops / ms / 1e9
        rows.append(Row("sdpa", f"{batch}x{seq_len} causal h{heads}", backend.name, ms,
                        tflops=tflops, ceiling_frac=tflops * 1e12 / BF16_FLOPS))  # fmt: skip
    return rows


def _padded_sdpa(q_lens: list[int], heads: int):
    batch, seq_len = len(q_lens), max(q_lens)
    q = torch.randn(batch, heads, seq_len, HEAD_QK, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(batch, heads, seq_len, HEAD_V, device="cuda", dtype=torch.bfloat16)
    name = sdpa_default_backend(q, k, v, True)
    return (lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)), name


def time_triton(q_lens: list[int], k_lens: list[int], heads: int, causal: bool) -> float:
    from pdserve.kernels.mla_prefill import triton as tri

    q, k, v, cu_q, cu_k = _varlen(q_lens, k_lens, heads)
    return time_ms(lambda: tri.mla_prefill(q, k, v, cu_q, cu_k, HEAD_QK**-0.5, causal))


def run(quick: bool) -> list[Row]:
    # (name, q_lens, k_lens, heads, causal, compare with padded SDPA)
    cases = [
        ("8x4096 causal h128", [4096] * 8, [4096] * 8, 128, True, True),
        ("8x4096 causal h16", [4096] * 8, [4096] * 8, 16, True, True),
    ]
    if not quick:
        ragged = [4096, 1, 2500, 777, 8192, 1024, 3000, 300]
        cases += [
            ("ragged 8 seqs (20k tok) causal h128", ragged, ragged, 128, True, False),
            ("4x1024 over 8192 prefix h128", [1024] * 4, [8192] * 4, 128, False, False),
            ("1x16384 causal h16", [16384], [16384], 16, True, True),
        ]
    rows = []
    for name, q_lens, k_lens, heads, causal, with_sdpa in cases:
        ms = time_triton(q_lens, k_lens, heads, causal)
        tflops = _flops(q_lens, k_lens, heads, causal) / ms / 1e9
        row = Row("mla_prefill", name, "triton", ms, tflops=tflops,
                  ceiling_frac=tflops * 1e12 / BF16_FLOPS)  # fmt: skip
        if with_sdpa:
            fn, backend = _padded_sdpa(q_lens, heads)
            row.peer, row.peer_ms = f"sdpa padded ({backend})", time_ms(fn)
            del fn
        rows.append(row)
        torch.cuda.empty_cache()
    if not quick:
        rows += sdpa_backends(8, 4096, 128)
    return rows
