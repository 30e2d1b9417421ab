"""`ForwardBatch`: the contract between a worker's scheduler and one forward pass of the model.

A batch packs T new tokens of B requests. Request b contributes query_lens[b] tokens starting at position
num_computed_tokens[b] (its cached prefix); its pages, in order, hold positions 0, page_size, 2*page_size, ...
A decode batch gives every request the same number of query tokens (1, or up to 4 for MTP verification).

A prefill chunk attends to its request's cached prefix by expanding the prefix's latents to per-head keys and
values; a long prefix is expanded in blocks (`PrefixBlock`), so that the expansion's memory is bounded by
`PREFIX_BLOCK_TOKENS` whatever the prompt's length, and each block's attention is merged into the chunk's by
its log-sum-exp. A request's blocks are cut at fixed positions (multiples of the block size) and merged in
position order, whatever else shares the batch, so that batch invariance holds.
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


PREFIX_BLOCK_TOKENS = 8192
"""The most cached-prefix tokens one block of prefix attention expands (summed over its requests), and the
positions a request's prefix is cut at: `reserve_bytes_per_rank` counts one block's expansion."""


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixBlock:
    """Part of the batch's cached prefixes attended in one launch: at most one block of each request's."""

    slots: torch.Tensor  # [Tb] int64: the cache slots of the block's keys, request by request
    cu_seqlens: (
        torch.Tensor
    )  # [B + 1] int32: each request's keys in `slots` (none for most requests)


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
    prefix_blocks: tuple[
        PrefixBlock, ...
    ] = ()  # prefill: the cached prefixes, in blocks (merge order)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def split(self, seqs: int) -> tuple[ForwardBatch, ForwardBatch]:
        """A decode batch as two micro-batches: its first `seqs` requests, and the others (0 < seqs <
        num_seqs). Views of this batch's tensors, but for the second's query offsets; a micro-batch's
        `logits_indices` are its own rows."""
        if not self.is_decode or not 0 < seqs < self.num_seqs:
            raise ValueError(f"split({seqs}): needs a decode batch of more than {seqs} requests")
        t = seqs * self.num_queries_per_seq
        cu = self.cu_seqlens_q
        rows = torch.arange(self.num_tokens, device=self.input_ids.device)

        def part(tokens: slice, requests: slice, cu_seqlens: torch.Tensor, n: int) -> ForwardBatch:
            return ForwardBatch(
                True, self.input_ids[tokens], self.positions[tokens], self.slot_mapping[tokens],
                cu_seqlens, self.seq_lens[requests], self.page_table[requests], rows[:n],
                self.num_queries_per_seq,
            )  # fmt: skip

        first = part(slice(0, t), slice(0, seqs), cu[: seqs + 1], t)
        second = part(slice(t, None), slice(seqs, None), cu[seqs:] - cu[seqs], self.num_tokens - t)
        return first, second

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
    cu_q, seq_lens = [0], []
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
        cu_q.append(cu_q[-1] + end - start)
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

    prefix_blocks = () if decode else _prefix_blocks(chunks, page_size, device)
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
        prefix_blocks=prefix_blocks,
    )


def _slots(page_ids: Sequence[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """The cache slots of positions [start, end) of a request on `page_ids`, [end - start] int64."""
    first, last = start // page_size, -(-end // page_size)
    pages = torch.tensor(page_ids[first:last], dtype=torch.int64)
    rows = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
    offset = start - first * page_size
    return rows[offset : offset + end - start]


def _prefix_blocks(
    chunks: Sequence[SeqChunk], page_size: int, device, block_tokens: int | None = None
) -> tuple[PrefixBlock, ...]:
    """The batch's cached prefixes as blocks of prefix attention: request b's prefix cut at multiples of
    `block_tokens`; its pieces taken in position order, and each launch holding at most one piece of a request
    and at most `block_tokens` keys in all."""
    block = block_tokens or PREFIX_BLOCK_TOKENS
    launches: list[list[tuple[int, int, int]]] = []  # (request, start, end) per launch
    depth = max(c.num_computed_tokens for c in chunks)
    for lo in range(0, depth, block):
        pieces = [
            (b, lo, min(lo + block, c.num_computed_tokens))
            for b, c in enumerate(chunks)
            if c.num_computed_tokens > lo
        ]
        launch: list[tuple[int, int, int]] = []
        keys = 0
        for piece in pieces:
            if launch and keys + piece[2] - piece[1] > block:
                launches.append(launch)
                launch, keys = [], 0
            launch.append(piece)
            keys += piece[2] - piece[1]
        launches.append(launch)
    blocks = []
    for launch in launches:
        lens = [0] * len(chunks)
        for b, start, end in launch:
            lens[b] = end - start
        cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        slots = torch.cat([_slots(chunks[b].page_ids, page_size, s, e) for b, s, e in launch])
        blocks.append(
            PrefixBlock(slots.to(device, non_blocking=True), cu.to(device, non_blocking=True))
        )
    return tuple(blocks)
