"""fused_moe on DeepSeek-V3's routed experts under EP8: hidden 7168, moe intermediate 2048, 32 local
experts, top-8, at 4096 tokens (prefill) and 64 tokens (decode), balanced and Zipf-skewed routing; without
--quick also 256, 16 and 1 token (decode, balanced).

Peer for bf16: `torch._grouped_mm` with argsort permutation and index_add combine. Peer for fp8: the
Triton bf16 kernel in the same run (the target is fp8 >= 1.4x bf16). "fp8 input" rows take x already
quantized (as the model's ffn_norm hands it over) and so leave out x's quantization. Prefill rows count
6 * T * k * D * I flops; decode rows count the weight bytes of the experts that received a token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _bench import BF16_FLOPS, FP8_FLOPS, HBM_BYTES_PER_S, Row, time_ms

from pdserve.kernels.fp8_gemm.ref import quantize_weight
from pdserve.kernels.fp8_quant_triton import quantize_rows
from pdserve.kernels.fused_moe import triton as tri

HIDDEN, INTER, EXPERTS, TOP_K = 7168, 2048, 32, 8


def routing(num_tokens: int, skew: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-8 distinct experts per token: uniform ("balanced") or sampled without replacement with
    probability ~ 1/(rank+1) ("zipf", Gumbel top-k)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gumbel = -torch.log(-torch.log(torch.rand(num_tokens, EXPERTS, device="cuda", generator=g)))
    logits = gumbel
    if skew == "zipf":
        ranks = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.float32)
        logits = logits - torch.log(ranks)
    _, ids = torch.topk(logits, TOP_K, dim=-1)
    weights = torch.rand(num_tokens, TOP_K, device="cuda", generator=g)
    return weights / weights.sum(-1, keepdim=True), ids.int()


def grouped_mm_moe(x, w13, w2, weights, ids):
    """The peer: permute by argsort, two torch._grouped_mm, SiLU-mul, index_add combine."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    token = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=w13.shape[0]), 0).int()
    h = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
    inter = h.shape[1] // 2
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [T*k, D]
    y = y.float() * weights.reshape(-1)[order, None]
    return torch.zeros(t, x.shape[1], device=x.device).index_add_(0, token, y).to(x.dtype)


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [quantize_weight(w_e) for w_e in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def run(quick: bool) -> list[Row]:
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g) / INTER**0.5
    (w13_q, w13_s), (w2_q, w2_s) = _fp8(w13), _fp8(w2)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    rows = []
    cases = [(4096, "balanced"), (4096, "zipf"), (64, "balanced")]
    if not quick:
        cases += [(64, "zipf"), (16, "balanced"), (1, "balanced"), (256, "balanced")]
    for num_tokens, skew in cases:
        weights, ids = routing(num_tokens, skew)
        x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        shape = f"T={num_tokens} {skew} E={EXPERTS} k={TOP_K}"
        peer_ms = time_ms(lambda: grouped_mm_moe(x, w13, w2, weights, ids))  # noqa: B023
        bf16_ms = time_ms(lambda: tri.fused_moe(x, w13, w2, weights, ids))  # noqa: B023
        fp8_ms = time_ms(
            lambda: tri.fused_moe(x, w13_q, w2_q, weights, ids, w13_s, w2_s)  # noqa: B023
        )
        x_q = quantize_rows(x, 128, False)  # row-major scales, as rmsnorm(quant="both") lays it out
        fp8q_ms = time_ms(
            lambda: tri.fused_moe(x, w13_q, w2_q, weights, ids, w13_s, w2_s, x_q)  # noqa: B023
        )
        touched = int(torch.unique(ids).numel())
        for impl, ms, peer, p_ms, elem_bytes, peak in (
            ("triton bf16", bf16_ms, "torch._grouped_mm bf16", peer_ms, 2, BF16_FLOPS),
            ("triton fp8", fp8_ms, "triton bf16", bf16_ms, 1, FP8_FLOPS),
            ("triton fp8 (fp8 input)", fp8q_ms, "triton bf16", bf16_ms, 1, FP8_FLOPS),
        ):
            if num_tokens >= 1024:
                tflops = 6 * num_tokens * TOP_K * HIDDEN * INTER / ms / 1e9
                rows.append(Row("fused_moe", shape, impl, ms, tflops=tflops,
                                ceiling_frac=tflops * 1e12 / peak, peer=peer,
                                peer_ms=p_ms))  # fmt: skip
            else:
                weight_bytes = touched * 3 * HIDDEN * INTER * elem_bytes
                gbps = weight_bytes / ms / 1e6
                rows.append(Row("fused_moe", shape, impl, ms, gbps=gbps,
                                ceiling_frac=gbps * 1e9 / HBM_BYTES_PER_S, peer=peer,
                                peer_ms=p_ms))  # fmt: skip
    return rows
