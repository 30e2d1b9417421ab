"""Token sampling for a batch with mixed per-request parameters (plain torch reference).

Per row: temperature <= 0 means greedy (argmax of the raw logits, first index on ties). Otherwise the logits are
divided by the temperature and softmaxed; top-k (k <= 0 disables), then top-p (1.0 disables; the smallest set of
most likely tokens whose mass reaches p, always at least one), then min-p (0 disables; drop tokens with
p < min_p * p_max) keep a subset, and the token is drawn by the exponential race: argmax over kept tokens of
p_i / E_i with E_i = -log(u_i). The uniforms u_i come from a counter-based hash of (seed, step, token id), so a
request's draw depends only on its seed and how many tokens it has generated, never on its batch neighbours: the
prefill and decode workers reproduce the offline path exactly. The hash (uint32 "lowbias32") is part of the spec.
"""

from __future__ import annotations

import torch

_U32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def hash_u32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2**32); returns the same."""
    x = x & _U32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _U32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds, steps: [B] int64. Returns u: [B, V] fp32 in (0, 1)."""
    h = hash_u32(seeds & _U32)
    h = hash_u32(h ^ ((seeds >> 32) & _U32))
    h = hash_u32(h ^ (steps & _U32))  # [B]
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = hash_u32(h[:, None] ^ ((ids[None, :] * _GOLDEN) & _U32))  # [B, V]
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


def kept_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution a sampled row draws from, before renormalization: (probs [B, V] fp32, the softmax of
    logits / temperature; keep [B, V] bool, the tokens top-k, top-p and min-p keep). The row's token follows
    probs restricted to keep, renormalized. Shapes as `sample`'s."""
    vocab = logits.shape[-1]
    temp = temperature.float().clamp_min(1e-6)[:, None]
    probs = torch.softmax(logits.float() / temp, dim=-1)  # [B, V]
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).long()[:, None]
    keep_sorted = rank < k
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
    keep_sorted &= (mass_before < top_p.float()[:, None]) | (rank == 0)
    keep_sorted &= sorted_probs >= min_p.float()[:, None] * sorted_probs[:, :1]
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)  # [B, V]
    return probs, keep


def kept_distribution(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The distribution a sampled row draws from [B, V] fp32: `kept_probs` restricted and renormalized."""
    probs, keep = kept_probs(logits, temperature, top_k, top_p, min_p)
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def sample_with_distribution(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`'s token ids [B] and the kept distribution they were drawn from [B, V] (`kept_distribution`;
    a greedy row's is computed and unused)."""
    probs, keep = kept_probs(logits, temperature, top_k, top_p, min_p)
    kept = torch.where(keep, probs, 0.0)
    sampled_ids = race(kept, seeds, steps)
    greedy_ids = logits.float().argmax(-1)
    return torch.where(temperature <= 0, greedy_ids, sampled_ids), kept / kept.sum(-1, keepdim=True)


def race(weights: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Draws token ids [B] from the rows of `weights` [B, V] (nonnegative, not necessarily normalized; a row
    needs one positive weight) by the exponential race over the noise of (seed, step): the draw `sample` makes
    for the same seed and step where weights are its kept probabilities."""
    exp_noise = -torch.log(uniform_noise(seeds.long(), steps.long(), weights.shape[-1]))
    return torch.where(weights > 0, weights / exp_noise, -1.0).argmax(-1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """logits: [B, V]; temperature, top_p, min_p: [B] fp32; top_k: [B] int; seeds, steps: [B] int64.

    Returns token ids [B] int64.
    """
    return sample_with_distribution(logits, temperature, top_k, top_p, min_p, seeds, steps)[0]
