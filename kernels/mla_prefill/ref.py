"""MLA prefill attention over a packed variable-length batch (plain torch reference).

Naive (non-absorbed) form: per head, q and k have `qk_nope + qk_rope` dims (192 for V3), v has `v_head_dim` (128).
Sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows cu_seqlens_k[b]:cu_seqlens_k[b+1].
Causal masking is bottom-right aligned: query i of a sequence with Lq queries and Lk keys sees keys j <= i + Lk - Lq.
Chunked prefill calls this twice, causal over the chunk's own keys and non-causal over the cached prefix, and merges
the two with `merge_attn_states` through their log-sum-exps.
"""

from __future__ import annotations

import torch


def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [Tq, H, Dqk]; k: [Tk, H, Dqk]; v: [Tk, H, Dv]; cu_seqlens_*: [B + 1] int.

    Returns out [Tq, H, Dv] in q's dtype and lse [Tq, H] fp32 (natural log; -inf and out 0 for a query that sees
    no key).
    """
    num_heads, v_dim = q.shape[1], v.shape[-1]
    out = torch.zeros(q.shape[0], num_heads, v_dim, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q_len, k_len = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if q_len == 0 or k_len == 0:
            continue
        qb = q[cq[b] : cq[b + 1]].float().transpose(0, 1)  # [H, Lq, Dqk]
        kb = k[ck[b] : ck[b + 1]].float().transpose(0, 1)  # [H, Lk, Dqk]
        vb = v[ck[b] : ck[b + 1]].float().transpose(0, 1)  # [H, Lk, Dv]
        scores = torch.matmul(qb, kb.transpose(1, 2)) * softmax_scale  # [H, Lq, Lk]
        if causal:
            rows = torch.arange(q_len, device=q.device)[:, None]
            cols = torch.arange(k_len, device=q.device)[None, :]
            scores = scores.masked_fill(cols > rows + (k_len - q_len), float("-inf"))
        lse_b = torch.logsumexp(scores, dim=-1)  # [H, Lq]
        probs = torch.exp(scores - lse_b[..., None]).nan_to_num(0.0)
        out[cq[b] : cq[b + 1]] = torch.matmul(probs, vb).transpose(0, 1).to(q.dtype)
        lse[cq[b] : cq[b + 1]] = lse_b.transpose(0, 1)
    return out, lse


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combines attention over two disjoint key sets. out_*: [T, H, Dv]; lse_*: [T, H] fp32 (may be -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)  # [T, H]
    finite = torch.isfinite(lse)
    w_a = torch.where(finite, torch.exp(lse_a - lse), 0.0)[..., None]  # [T, H, 1]
    w_b = torch.where(finite, torch.exp(lse_b - lse), 0.0)[..., None]
    out = (out_a.float() * w_a + out_b.float() * w_b).to(out_a.dtype)
    return out, lse
