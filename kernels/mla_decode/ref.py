"""MLA decode attention in absorbed form over the paged latent KV cache (plain torch reference).

Every head attends to the same cached latent: a token's cache row is [c_kv (kv_lora_rank) | k_pe
(rope dims)]. Keys are whole rows, values are the first `kv_lora_rank` entries, so the output is in
latent space; the caller applies W_UV. The caller has already absorbed W_UK into q:
q = [q_nope @ W_UK | q_pe].

Each request has Q query tokens (1 for plain decode, up to 4 for MTP verification), the last Q
tokens of its sequence, already written to the cache: query j of request b sees cache positions
< seq_lens[b] - Q + 1 + j. Position p of request b lives in page page_table[b, p // page_size],
row p % page_size. A query that sees no position (seq_lens[b] < Q - j, e.g. a padded batch slot
with seq_len 0) gets out 0 and lse -inf.

The cache is either float ([num_pages, page_size, kv_lora_rank + rope], the dtype of q) or fp8:
uint8 [num_pages, page_size, kv_row_fp8.row_bytes(...)] in the row format of `kv_row_fp8` (e4m3
latent with a per-token fp32 scale, bf16 rope), written by `write_kv_fp8`.
"""

from __future__ import annotations

import torch

from ..kv_row_fp8 import dequantize_kv_fp8, quantize_kv_fp8


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Q, H, Dk]; kv_cache: [num_pages, page_size, Dk] (or uint8 fp8 rows);
    page_table: [B, max_pages] int; seq_lens: [B] int.

    Returns out [B, Q, H, kv_lora_rank] in q's dtype and lse [B, Q, H] fp32 (natural log).
    """
    batch, num_q, num_heads, head_dim = q.shape
    fp8 = kv_cache.dtype == torch.uint8
    page_size = kv_cache.shape[1]
    out = torch.empty(batch, num_q, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, num_q, num_heads, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        num_pages = -(-seq_len // page_size)
        pages = page_table[b, :num_pages].long()
        kv = kv_cache[pages].reshape(num_pages * page_size, kv_cache.shape[-1])[:seq_len]
        if fp8:  # only this request's rows: a cache holds up to millions
            kv = dequantize_kv_fp8(kv, kv_lora_rank, head_dim - kv_lora_rank)
        kv = kv.float()  # [L, Dk]
        qb = q[b].float()  # [Q, H, Dk]
        scores = torch.einsum("qhd,ld->qhl", qb, kv) * softmax_scale  # [Q, H, L]
        visible = seq_len - num_q + 1 + torch.arange(num_q, device=q.device)  # [Q]
        cols = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(cols[None, None, :] >= visible[:, None, None], float("-inf"))
        lse_b = torch.logsumexp(scores, dim=-1)  # [Q, H]; -inf where nothing is visible
        lse_safe = lse_b.masked_fill(lse_b == float("-inf"), 0.0)  # rows that see nothing: probs 0
        probs = torch.exp(scores - lse_safe[..., None])
        out[b] = torch.einsum("qhl,ld->qhd", probs, kv[:, :kv_lora_rank]).to(q.dtype)
        lse[b] = lse_b
    return out, lse


def write_kv_fp8(
    kv_cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
) -> None:
    """Quantizes T tokens' [c_kv | k_pe] and stores them at flat slots (page * page_size + row) of
    an fp8 cache [num_pages, page_size, row_bytes] uint8, in place. slots: [T] int; c_kv: [T, L];
    k_pe: [T, R]."""
    slots = slots.long()
    page_size = kv_cache.shape[1]
    kv_cache[slots // page_size, slots % page_size] = quantize_kv_fp8(c_kv, k_pe)


def write_kv(
    kv_cache: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
) -> None:
    """Stores T tokens' [c_kv | k_pe], cast to the cache's dtype, at flat slots (page * page_size + row) of
    a float cache [num_pages, page_size, L + R] (any page stride: a layer of the page-major cache), in
    place. slots: [T] int; c_kv: [T, L]; k_pe: [T, R] (any row strides)."""
    slots = slots.long()
    page_size, lora = kv_cache.shape[1], c_kv.shape[1]
    page, row = slots // page_size, slots % page_size
    kv_cache[page, row, :lora] = c_kv.to(kv_cache.dtype)
    kv_cache[page, row, lora:] = k_pe.to(kv_cache.dtype)
