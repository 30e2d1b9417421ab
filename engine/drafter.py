"""`MTPDrafter`: the MTP module's passes of a step that speculates (`StepPlan.mtp`): over a pass's rows, writing
the module's cache layer at their positions, and the drafts of the tokens after each sampled row.

The module at position t reads the main model's final hidden state h_t and the token at t + 1 and predicts the
token at t + 2; its cache layer holds, per position t, the latent of that input. So:
- after a prefill pass, it runs over each chunk's positions with the chunk's tokens shifted by one (the chunk's
  `next_token`, or the token the chunk sampled, last); a chunk that sampled gets one draft, from its last row;
- after a decode pass, it runs over the pass's rows with, per row, the token that follows it in the request's
  sequence (a verify group's kept tokens, a replayed row's successor, a plain row's sampled token); each
  request's draft 1 comes from the row of its last kept token, and drafts 2..k from a chain of k - 1 passes of
  one row per request, each at the next position, fed the previous pass's hidden state and draft (the one
  module reused at every depth; a checkpoint with several uses module j at depth j).
Positions of rejected drafts hold stale latents until the next step's pass writes them again, before any row
reads them (a row reads only positions up to its own)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import torch

from pdserve.engine.draft_graphs import DraftGraphs
from pdserve.engine.sampler import PenaltyCounts
from pdserve.engine.speculative import DraftProbs, Verified, draft_tokens, verify, verify_groups
from pdserve.engine.step import DecodeRow, PrefillRow, SampleSpec
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.deepseek import Transformer
from pdserve.model.errors import ConfigError
from pdserve.model.kv_cache import PagedKVCache


@dataclasses.dataclass(frozen=True, slots=True)
class Drafts:
    tokens: list[list[int]]
    """Per row of the pass: the drafts proposed after the tokens the row's request keeps ([] elsewhere)."""
    probs: dict[str, torch.Tensor | None]
    """Per request that got drafts: their draft distributions [k, V] (None for a greedy request)."""


def check_speculation(model: Transformer, num_drafts: int) -> int:
    """`num_drafts`; raises ConfigError where it asks for speculation from a model without an MTP module."""
    if num_drafts and model.num_mtp == 0:
        raise ConfigError(
            f"num_speculative_tokens={num_drafts}: speculation drafts with the checkpoint's MTP module, and "
            "this checkpoint has none (num_nextn_predict_layers=0 or no MTP tensors)"
        )
    return num_drafts


class MTPDrafter:
    def __init__(self, model: Transformer, cache: PagedKVCache):
        check_speculation(model, 1)
        self.model, self.cache = model, cache
        self.page_size = cache.layout.page_size
        self.device = cache.device
        self.max_position = model.args.max_position_embeddings
        self.graphs: DraftGraphs | None = None
        """Where the runner replays decode graphs: the decode passes' drafting as graphs too."""

    def verify(
        self, logits: torch.Tensor, rows: Sequence[DecodeRow], counts: PenaltyCounts,
        draft_probs: DraftProbs, relaxed: tuple[int, float] | None = None, masks=None,
    ) -> Verified:  # fmt: skip
        """The decode pass's tokens and accepted drafts (`speculative.verify`)."""
        return verify(logits, rows, counts, draft_probs, relaxed, masks)

    def depth_module(self, depth: int) -> int:
        """The MTP module drafting at `depth` (0: the first draft)."""
        return min(depth, self.model.num_mtp - 1)

    def after_prefill(
        self, rows: Sequence[PrefillRow], hidden: torch.Tensor, tokens: Sequence[int | None],
        num_drafts: int,
    ) -> Drafts:  # fmt: skip
        """rows: the prefill pass's rows; hidden: its final hidden states [T, D]; tokens: each row's sampled
        token (None where it sampled none). A row whose next token is not known (neither given nor sampled)
        leaves its last position's MTP latent to the step that knows it."""
        chunks, keep_rows, last_rows = [], [], []
        at = 0
        for r, row in enumerate(rows):
            nxt = row.next_token if tokens[r] is None else tokens[r]
            shifted = list(row.token_ids[1:]) + ([] if nxt is None else [nxt])
            n = len(row.token_ids)
            if shifted:
                chunks.append(SeqChunk(shifted, row.start, row.page_ids))
                keep_rows.extend(range(at, at + len(shifted)))
                last_rows.append(len(keep_rows) - 1 if tokens[r] is not None else -1)
            else:
                last_rows.append(-1)
            at += n
        out = Drafts([[] for _ in rows], {})
        if not chunks:
            self.model.mtp_idle(0)
            return out
        batch = build_forward_batch(chunks, self.page_size, self.device, decode=False)
        index = torch.tensor(keep_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        mtp_hidden = self.model.mtp_forward(
            self.depth_module(0), hidden[index], batch.input_ids, batch, self.cache
        )
        # rows that sampled: one draft each (a chain would write positions past the prompt's pages)
        sampled = [(r, i) for r, i in zip(range(len(rows)), last_rows, strict=True) if i >= 0]
        sampled_rows = [r for r, _ in sampled]
        if num_drafts and sampled:
            pick = torch.tensor([i for _, i in sampled], dtype=torch.int64).to(self.device)
            logits = self.model.mtp_head(self.depth_module(0), mtp_hidden[pick])
            specs = [rows[r].sample for r in sampled_rows]
            drafted, q = draft_tokens(logits, specs, [s.step + 1 for s in specs])
            for j, (r, d) in enumerate(zip(sampled_rows, drafted, strict=True)):
                out.tokens[r] = [d]
                q_row = _q_row(q, j, specs[j])
                out.probs[rows[r].request_id] = None if q_row is None else q_row[None]  # [1, V]
        return out

    def after_decode(
        self, rows: Sequence[DecodeRow], hidden: torch.Tensor, verified: Verified, num_drafts: int,
        chain_passes: int, graph_key: tuple[int, int] | None = None,
    ) -> Drafts:  # fmt: skip
        """rows: the decode pass's rows; hidden: their final hidden states [R, D]; verified: their tokens;
        chain_passes: the passes after the first every rank of the worker runs this step (`num_drafts` - 1
        where any rank has decode rows): a pass with no row of this rank joins the others' exchanges;
        graph_key: the decode graph bucket the rows ran in, where they did and the drafting may replay a
        graph too (`DraftGraphs`)."""
        n = len(rows)
        nxt, last = [], []  # per row its successor's token; the rows each request goes on from
        for r, row in enumerate(rows):
            follows = r + 1 < n and rows[r + 1].request_id == row.request_id
            if follows and verified.group_of[r] < 0:
                nxt.append(rows[r + 1].token_id)  # a replayed row: its successor is known
            else:
                nxt.append(verified.tokens[r])
            if row.drafts:
                last.append(r + verified.accepted[r] - 1)
            elif verified.group_of[r] < 0 and not follows:
                last.append(r)
        out = Drafts([[] for _ in rows], {})
        if (
            graph_key is not None and self.graphs is not None
            and chain_passes == max(num_drafts - 1, 0)
            and max(row.position for row in rows) + 2 * num_drafts < self.max_position
        ):  # fmt: skip
            specs = [_next_step(rows[r].sample) for r in last]
            ran = self.graphs.run(graph_key, n, nxt, last, specs, num_drafts)
            if ran is not None:
                drafts, probs = ran
                for j, r in enumerate(last):
                    out.tokens[r] = drafts[j]
                    sampled = probs is not None and specs[j].temperature > 0
                    out.probs[rows[r].request_id] = probs[:, j].clone() if sampled else None
                return out
        chunks = [
            SeqChunk([t], row.position, row.page_ids) for t, row in zip(nxt, rows, strict=True)
        ]
        batch = build_forward_batch(chunks, self.page_size, self.device, decode=True)
        mtp_hidden = self.model.mtp_forward(
            self.depth_module(0), hidden[: len(rows)], batch.input_ids, batch, self.cache
        )
        if not num_drafts:
            for _ in range(chain_passes):
                self.model.mtp_idle(self.depth_module(1))
            return out
        pick = torch.tensor(last, dtype=torch.int64).to(self.device, non_blocking=True)
        x = mtp_hidden[pick]  # [B, D]
        specs = [_next_step(rows[r].sample) for r in last]
        logits = self.model.mtp_head(self.depth_module(0), x)
        drafted, q = draft_tokens(logits, specs, [s.step for s in specs])
        drafts = [[d] for d in drafted]
        probs = [[_q_row(q, j, s)] for j, s in enumerate(specs)]
        positions = [rows[r].position + 1 for r in last]  # the draft's input position
        pages = [rows[r].page_ids for r in last]
        live = list(range(len(last)))
        for depth in range(1, chain_passes + 1):
            live = [j for j in live if positions[j] + depth - 1 < self.max_position - 1]
            if depth >= num_drafts or not live:
                self.model.mtp_idle(self.depth_module(depth))
                continue
            chunks = [SeqChunk([drafts[j][-1]], positions[j] + depth - 1, pages[j]) for j in live]
            batch = build_forward_batch(chunks, self.page_size, self.device, decode=True)
            index = torch.tensor(live, dtype=torch.int64).to(self.device, non_blocking=True)
            module = self.depth_module(depth)
            h = self.model.mtp_forward(module, x[index], batch.input_ids, batch, self.cache)
            x = x.index_copy(0, index, h)
            live_specs = [specs[j] for j in live]
            logits = self.model.mtp_head(module, h)
            more, q = draft_tokens(logits, live_specs, [s.step + depth for s in live_specs])
            for i, (j, d) in enumerate(zip(live, more, strict=True)):
                drafts[j].append(d)
                probs[j].append(_q_row(q, i, live_specs[i]))
        for j, r in enumerate(last):
            out.tokens[r] = drafts[j]
            rows_q = probs[j]
            out.probs[rows[r].request_id] = (
                None if rows_q[0] is None else torch.stack(rows_q)  # [k, V]
            )
        return out


def _next_step(spec: SampleSpec) -> SampleSpec:
    """The sampling fields of a row's request at the step of its first draft: one past the row's (the row
    of its last kept token)."""
    return dataclasses.replace(spec, step=spec.step + 1, penalty_ids=None)


def _q_row(q: torch.Tensor | None, j: int, spec: SampleSpec) -> torch.Tensor | None:
    return None if q is None or spec.temperature <= 0 else q[j]


class OracleDrafter(MTPDrafter):
    """For benchmarks and tests only: runs the MTP module's passes as `MTPDrafter` does (so a step costs what
    it would), then replaces each draft by the token the request's known continuation has at its position,
    itself replaced by another token with probability 1 - `acceptance` (fixed by `seed`, the request and the
    position). Greedy requests whose continuation is the target's own then accept each draft with probability
    `acceptance`. Its drafts are verified as drawn from a point mass.

    `forced`: for speed alone, where the target's greedy tokens under speculation are not the known
    continuation's (off batch-invariant mode a random-weight model's near-tied logits flip with the rows a
    step runs): each draft is accepted with probability `acceptance` whatever its token, and a group's tokens
    are its accepted drafts and the target's token after them. Steps then run the rows an acceptance of
    `acceptance` gives; the tokens mean nothing."""

    def __init__(
        self, model: Transformer, cache: PagedKVCache, sequences: dict[str, Sequence[int]],
        acceptance: float, seed: int = 0, forced: bool = False,
    ):  # fmt: skip
        """sequences: per request id, its prompt and continuation (token at position i at index i)."""
        super().__init__(model, cache)
        if not 0 <= acceptance <= 1:
            raise ValueError(f"acceptance={acceptance}: must be in [0, 1]")
        self.sequences, self.acceptance, self.seed = sequences, acceptance, seed
        self.forced = forced
        self.vocab_size = model.args.vocab_size

    def verify(self, logits, rows, counts, draft_probs, relaxed=None, masks=None):  # type: ignore[override]
        verified = super().verify(logits, rows, counts, draft_probs, relaxed, masks)
        if not self.forced:
            return verified
        tokens, accepted = list(verified.tokens), list(verified.accepted)
        target = logits.argmax(-1).tolist()
        for s in verify_groups(rows)[1]:
            k, a = rows[s].drafts, 0
            rng = random.Random(f"{self.seed}:{rows[s].request_id}:{rows[s].position}")
            while a < k and rng.random() < self.acceptance:
                tokens[s + a] = rows[s + a + 1].token_id
                a += 1
            tokens[s + a] = target[s + a]
            accepted[s] = a + 1
        return dataclasses.replace(verified, tokens=tokens, accepted=accepted)

    def _oracle(self, request_id: str, position: int, drafted: int) -> int:
        seq = self.sequences.get(request_id)
        if seq is None or position >= len(seq):
            return drafted
        rng = random.Random(f"{self.seed}:{request_id}:{position}")
        if rng.random() < self.acceptance:
            return seq[position]
        return (seq[position] + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size

    def _replace(self, out: Drafts, rows: Sequence, last_positions: list[int | None]) -> Drafts:
        for r, drafts in enumerate(out.tokens):
            if drafts and last_positions[r] is not None:
                rid = rows[r].request_id
                p = last_positions[r]  # the position of the row's last kept token's KV
                out.tokens[r] = [self._oracle(rid, p + 1 + j, d) for j, d in enumerate(drafts, 1)]
                out.probs[rid] = None
        return out

    def after_prefill(self, rows, hidden, tokens, num_drafts):  # type: ignore[override]
        out = super().after_prefill(rows, hidden, tokens, num_drafts)
        last = [row.start + len(row.token_ids) - 1 for row in rows]
        return self._replace(out, rows, last)

    def after_decode(  # type: ignore[override]
        self, rows, hidden, verified, num_drafts, chain_passes, graph_key=None
    ):
        out = super().after_decode(rows, hidden, verified, num_drafts, chain_passes, graph_key)
        last: list[int | None] = [None] * len(rows)
        for r, row in enumerate(rows):
            if out.tokens[r]:
                last[r] = row.position
        return self._replace(out, rows, last)
