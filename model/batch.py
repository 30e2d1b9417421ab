"""`ForwardBatch`: the contract between a worker's scheduler and one forward pass of the model.

A batch packs T new tokens of B requests. Request b contributes query_lens[b] tokens starting at position
num_computed_tokens[b] (its cached prefix); its pages, in order, hold positions 0, page_size, 2*page_size, ...
A decode batch gives every request the same number of query tokens (1, or up to 4 for MTP verification).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class SeqChunk:
    """One request's share of a forward pass."""

    token_ids: Sequence[int]
    """The new tokens to run (the whole prompt, a chunk of it, or the last sampled token)."""
    num_computed_tokens: int
    """Tokens of this request already in the cache; the first new token sits at this position."""
    page_ids: Sequence[int]
    """Cache pages of the request, in position order, covering every position up to the last new token."""


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardBatch:
    is_decode: bool
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset of each new token
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: cached tokens once this step's tokens are written
    page_table: torch.Tensor  # [B, max_pages] int32
    logits_indices: torch.Tensor  # [N] int64: rows of the hidden states that need logits
    num_queries_per_seq: int  # decode: query tokens per request; prefill: 0
    prefix_slots: (
        torch.Tensor | None
    )  # [Tp] int64: slots of every request's cached prefix, in order
    cu_seqlens_prefix: torch.Tensor | None  # [B + 1] int32

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_forward_batch(
    chunks: Sequence[SeqChunk],
    page_size: int,
    device: torch.device | str,
    decode: bool,
    all_logits: bool = False,
) -> ForwardBatch:
    """Packs `chunks` into tensors on `device`. Logits rows: the last token of each chunk, or every token."""
    if not chunks:
        raise ValueError("a forward batch needs at least one request")
    query_lens = [len(c.token_ids) for c in chunks]
    if min(query_lens) == 0:
        raise ValueError("every request in a batch needs at least one new token")
    if decode and len(set(query_lens)) != 1:
        raise ValueError(f"a decode batch needs equal query lengths, got {sorted(set(query_lens))}")
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    prefix_slots: list[int] = []
    cu_q, cu_prefix, seq_lens = [0], [0], []
    max_pages = 0
    for c in chunks:
        start, end = c.num_computed_tokens, c.num_computed_tokens + len(c.token_ids)
        if len(c.page_ids) * page_size < end:
            raise ValueError(
                f"{len(c.page_ids)} pages cannot hold {end} tokens at page_size {page_size}"
            )
        input_ids.extend(c.token_ids)
        positions.extend(range(start, end))
        slots.extend(
            c.page_ids[p // page_size] * page_size + p % page_size for p in range(start, end)
        )
        if not decode:
            prefix_slots.extend(
                c.page_ids[p // page_size] * page_size + p % page_size for p in range(start)
            )
        cu_q.append(cu_q[-1] + end - start)
        cu_prefix.append(cu_prefix[-1] + start)
        seq_lens.append(end)
        max_pages = max(max_pages, -(-end // page_size))
    page_table = torch.zeros(len(chunks), max_pages, dtype=torch.int32)
    for b, c in enumerate(chunks):
        n = -(-seq_lens[b] // page_size)
        page_table[b, :n] = torch.tensor(c.page_ids[:n], dtype=torch.int32)
    if all_logits:
        logits_indices = list(range(cu_q[-1]))
    else:
        logits_indices = [end - 1 for end in cu_q[1:]]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    has_prefix = not decode and cu_prefix[-1] > 0
    return ForwardBatch(
        is_decode=decode,
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor(slots, torch.int64),
        cu_seqlens_q=tensor(cu_q, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        page_table=page_table.to(device, non_blocking=True),
        logits_indices=tensor(logits_indices, torch.int64),
        num_queries_per_seq=query_lens[0] if decode else 0,
        prefix_slots=tensor(prefix_slots, torch.int64) if has_prefix else None,
        cu_seqlens_prefix=tensor(cu_prefix, torch.int32) if has_prefix else None,
    )
