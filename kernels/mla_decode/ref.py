"""MLA decode attention in absorbed form over the paged latent KV cache (plain torch reference).

Every head attends to the same cached latent: a token's cache row is [c_kv (kv_lora_rank) | k_pe (rope dims)].
Keys are whole rows, values are the first `kv_lora_rank` entries, so the output is in latent space; the caller
applies W_UV. The caller has already absorbed W_UK into q: q = [q_nope @ W_UK | q_pe].

Each request has Q query tokens (1 for plain decode, up to 4 for MTP verification), the last Q tokens of its
sequence, already written to the cache: query j of request b sees cache positions < seq_lens[b] - Q + 1 + j.
Position p of request b lives in page page_table[b, p // page_size], row p % page_size.
"""

from __future__ import annotations

import torch


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Q, H, Dk]; kv_cache: [num_pages, page_size, Dk]; page_table: [B, max_pages] int; seq_lens: [B] int.

    Returns out [B, Q, H, kv_lora_rank] in q's dtype and lse [B, Q, H] fp32.
    """
    batch, num_q, num_heads, _ = q.shape
    page_size = kv_cache.shape[1]
    out = torch.empty(batch, num_q, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, num_q, num_heads, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        num_pages = -(-seq_len // page_size)
        pages = page_table[b, :num_pages].long()
        kv = kv_cache[pages].reshape(num_pages * page_size, -1)[:seq_len].float()  # [L, Dk]
        qb = q[b].float()  # [Q, H, Dk]
        scores = torch.einsum("qhd,ld->qhl", qb, kv) * softmax_scale  # [Q, H, L]
        visible = seq_len - num_q + 1 + torch.arange(num_q, device=q.device)  # [Q]
        cols = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(cols[None, None, :] >= visible[:, None, None], float("-inf"))
        lse_b = torch.logsumexp(scores, dim=-1)  # [Q, H]
        probs = torch.exp(scores - lse_b[..., None])
        out[b] = torch.einsum("qhl,ld->qhd", probs, kv[:, :kv_lora_rank]).to(q.dtype)
        lse[b] = lse_b
    return out, lse
