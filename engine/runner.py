"""`ModelRunner`: executes one rank's share of a step plan (`pdserve.engine.step`) over one model and its KV
cache, and samples. It holds no policy: which requests run, and when, is the scheduler's business; the plan is
all it is told."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.draft_graphs import DraftGraphs
from pdserve.engine.drafter import MTPDrafter
from pdserve.engine.grammar_masks import GrammarMatchers
from pdserve.engine.host_store import HostKVStore, host_slots
from pdserve.engine.rank_memory import GPU_MEMORY_UTILIZATION
from pdserve.engine.ranks.wire import max_pages, prefill_tokens
from pdserve.engine.sampler import PenaltyCounts, sample, target_logprobs, to_token_logprobs
from pdserve.engine.sampling_params import TokenLogprobs
from pdserve.engine.speculative import DraftProbs
from pdserve.engine.step import NO_LOGPROBS, DecodeRow, PrefillRow, RankResult, StepPlan
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.deepseek import Transformer
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache, capacity_pages, resolve_cache_dtype

logger = logging.getLogger(__name__)

PROMPT_LOGITS_ROWS = 64
"""Positions whose logits a prefill makes at once for prompt log-probabilities: their fp32 logits, log-softmax
and comparison mask (about 9 bytes per vocabulary entry and row) stay well within the step's activation reserve
(`rank_memory.reserve_bytes_per_rank`), which the forward pass has freed by then."""


def split_chunks(chunks: Sequence[SeqChunk]) -> tuple[list[SeqChunk], list[SeqChunk]]:
    """`chunks` as two lists holding the first ceil(T / 2) of their T tokens and the rest, in order: the chunk
    the cut falls in goes on in the second list from the token after the cut."""
    total = sum(len(c.token_ids) for c in chunks)
    cut, first, second = -(-total // 2), [], []
    for c in chunks:
        n = len(c.token_ids)
        if cut >= n:
            first.append(c)
        elif cut <= 0:
            second.append(c)
        else:
            first.append(SeqChunk(c.token_ids[:cut], c.num_computed_tokens, c.page_ids))
            second.append(SeqChunk(c.token_ids[cut:], c.num_computed_tokens + cut, c.page_ids))
        cut -= n
    return first, second


class ModelRunner:
    """`num_pages` usable pages (ids 0 .. num_pages - 1). On a GPU with `cuda_graphs`, decode steps replay CUDA
    graphs and the cache holds one more page, the graphs' scratch page, which no request may own."""

    def __init__(
        self, model: Transformer, page_size: int, num_pages: int, kv_cache_dtype: str = "auto",
        cuda_graphs: bool = True, rank: int = 0, host_kv_cache_bytes: int = 0,
    ):  # fmt: skip
        """rank: which `RankStep` of each plan this runner executes; host_kv_cache_bytes: host memory for the
        host tier's pool of evicted cached pages (`HostKVStore`; 0: off)."""
        self.model, self.page_size, self._num_pages = model, page_size, num_pages
        self.rank = rank
        self.device = model.embed.weight.device
        layout = KVCacheLayout.for_model(
            model.args, page_size, resolve_cache_dtype(kv_cache_dtype, model.dtype), model.num_mtp
        )
        use_graphs = cuda_graphs and self.device.type == "cuda"
        self.cache = PagedKVCache(layout, num_pages + int(use_graphs), self.device)
        self.graphs = (
            DecodeGraphs(model, self.cache, scratch_page=num_pages) if use_graphs else None
        )
        slots = host_slots(host_kv_cache_bytes, layout.page_bytes)
        self.host_store = HostKVStore(self.cache, slots) if slots else None
        """The host tier's memory, where it is on; the scheduler's `HostPool` of as many slots decides the
        copies (`StepPlan.host_copies`)."""
        self.penalty_counts = PenaltyCounts()
        """The penalties' counts of the requests this runner samples (kept between steps)."""
        self.draft_probs = DraftProbs()
        """The draft distributions of the drafts this runner proposed last step (kept to verify them)."""
        checkpoint = getattr(model, "checkpoint_dir", None)
        self.grammar = GrammarMatchers(
            Path(checkpoint) / "tokenizer.json" if checkpoint else None,
            model.args.vocab_size,
            model.args.eos_token_ids,
        )
        """The grammar matchers of the constrained requests this runner samples (kept between steps)."""
        self._row_errors: dict[str, str] = {}
        """The step's requests whose rows failed alone (`RankResult.row_errors`)."""
        self.drafter: MTPDrafter | None = None
        """Runs the MTP module's passes of a plan that asks (made at the first; a benchmark may set its own)."""

    @classmethod
    def sized(
        cls,
        model: Transformer,
        page_size: int,
        num_pages: int | None,
        gpu_memory_fraction: float,
        cpu_cache_bytes: int,
        cuda_graphs: bool = True,
        kv_cache_dtype: str = "auto",
        rank: int = 0,
        reserve_bytes: int = 0,
        host_kv_cache_bytes: int = 0,
    ) -> ModelRunner:
        """A runner whose cache has `num_pages`, or as many as `capacity_pages` finds room for beside
        `reserve_bytes` (`engine.rank_memory.worker_reserve_bytes`)."""
        cache_dtype = resolve_cache_dtype(kv_cache_dtype, model.dtype)
        layout = KVCacheLayout.for_model(model.args, page_size, cache_dtype, model.num_mtp)
        device = model.embed.weight.device
        pages = capacity_pages(
            layout, device, num_pages, gpu_memory_fraction, cpu_cache_bytes, reserve_bytes,
            GPU_MEMORY_UTILIZATION if reserve_bytes else 1.0,
        )  # fmt: skip
        if num_pages is None and device.type == "cuda" and cuda_graphs:
            pages -= 1  # room for the graphs' scratch page
        return cls(model, page_size, pages, kv_cache_dtype, cuda_graphs, rank, host_kv_cache_bytes)

    def close(self) -> None:
        """Releases the decode graphs (see `DecodeGraphs.close`); steps after it run eagerly."""
        if self.drafter is not None and self.drafter.graphs is not None:
            self.drafter.graphs.close()
            self.drafter.graphs = None
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None

    @property
    def num_pages(self) -> int:
        """Pages requests may own."""
        return self._num_pages

    def _on_device(self):
        """Triton launches on the calling thread's current CUDA device, which is per thread: make it ours."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def execute(self, plan: StepPlan) -> RankResult:
        """Runs this rank's rows of `plan`: the prefill pass, then the decode pass. A pass that raises fails
        alone: its error is returned (and logged), the other pass still runs.

        Under an expert-parallel layout with data-parallel attention every rank must issue the same collectives
        each step: a pass that some rank runs is run by every rank, those without rows of it running the
        model's idle forward (which joins each MoE layer's expert exchange). The plan tells each rank every
        rank's rows, so the exchanges pad to the pass's largest rank without asking the others (no host sync),
        and the decode pass runs in the CUDA-graph bucket of the largest rank on every rank (a rank without
        rows replays it with padding rows)."""
        step = plan.ranks[self.rank]
        result = RankResult(plan.step_id)
        self._row_errors = result.row_errors
        joins = self._joins_idle
        if plan.mtp and self.drafter is None:
            self.drafter = MTPDrafter(self.model, self.cache)
        if self.host_store is not None:  # the copies issued since the last step, then the plan's
            with self._on_device():
                self.host_store.wait()
                if plan.host_copies:
                    self.host_store.run(plan.host_copies[self.rank])
        elif plan.host_copies and plan.host_copies[self.rank]:
            raise RuntimeError("a plan with host-tier copies for a runner without a host pool")
        if any(r.prefill for r in plan.ranks) and (step.prefill or joins):
            tokens = max(prefill_tokens(s.prefill) for s in plan.ranks)
            with self.model.step_tokens(
                tokens if joins else None, two_batches=self._two_batches(joins, tokens)
            ):
                if not step.prefill:
                    self._run(self._idle, plan.mtp)
                else:
                    try:
                        tokens, logprobs, drafts, prompt = self._run(
                            self._prefill, step.prefill, plan
                        )
                        result.prefill_tokens.extend(tokens)
                        result.prefill_logprobs.extend(logprobs)
                        result.prefill_drafts.extend(drafts)
                        result.prefill_prompt_logprobs.extend(prompt)
                    except Exception as e:  # the scheduler fails this pass's requests; we go on
                        logger.error("prefill pass failed", exc_info=True)
                        result = dataclasses.replace(result, prefill_error=str(e))
        if any(r.decode for r in plan.ranks) and (step.decode or joins):
            rows = max(len(s.decode) for s in plan.ranks)
            key = None
            if joins and self.graphs is not None and self.graphs.enabled:
                width = max(max_pages(s.decode) for s in plan.ranks)
                key = self.graphs.key(rows, width)
            drafting = plan.mtp and plan.num_drafts > 0  # the decode pass's MTP passes
            chain = plan.num_drafts - 1 if drafting else 0
            tokens = key[0] if key else rows
            two = self._two_batches(joins, tokens)
            with self.model.step_tokens(tokens if joins else None, two_batches=two):
                if not step.decode:
                    self._run(self._idle_decode, key, drafting, chain)
                else:
                    try:
                        out = self._run(self._decode, step.decode, key, plan, chain)
                        result.decode_tokens.extend(out[0])
                        result.decode_logprobs.extend(out[1])
                        result.decode_accepted.extend(out[2])
                        result.decode_drafts.extend(out[3])
                    except Exception as e:  # as above
                        logger.error("decode pass failed", exc_info=True)
                        result = dataclasses.replace(result, decode_error=str(e))
        if len(self.penalty_counts) or len(self.draft_probs) or len(self.grammar):
            # the requests not in this step are gone from this runner
            sampled = [r.request_id for r in step.prefill if r.sample is not None]
            live = {*sampled, *(r.request_id for r in step.decode)}
            self.penalty_counts.keep(live)
            self.draft_probs.keep(live)
            self.grammar.keep(live)
        if self.model.balancer is not None:  # collective: every rank, after every step
            with self._on_device():
                self.model.balancer.after_step()
        return result

    def _two_batches(self, joins: bool, tokens: int) -> bool:
        """Whether a pass of `tokens` tokens on the step's largest rank (or its graph bucket) runs as two
        micro-batches (`WorkerLayout.overlap_rows`): decided from what every rank knows, so all agree."""
        overlap = self.model.layout.worker.overlap_rows
        return joins and bool(overlap) and tokens >= overlap and self.model.can_run_two_batches

    @property
    def _joins_idle(self) -> bool:
        """Whether a rank with no rows must still run a pass: its MoE layers exchange tokens with the others."""
        layout = self.model.layout
        return layout.worker.expert_parallel > 1 and not layout.worker.same_tokens_on_all_ranks

    def _idle(self, mtp: bool) -> None:
        self.model.forward_idle()
        if mtp:
            self.model.mtp_idle(0)

    def _idle_decode(self, key: tuple[int, int] | None, mtp: bool, chain: int) -> None:
        if key is None or not self.graphs.idle(key):
            self.model.forward_idle()
        if mtp:
            for depth in range(chain + 1):
                self.model.mtp_idle(self.drafter.depth_module(depth))

    @torch.inference_mode()
    def _run(self, run_pass, *args):
        with self._on_device():
            return run_pass(*args)

    def _prefill(self, rows: Sequence[PrefillRow], plan: StepPlan) -> tuple[
        list[int | None], list[TokenLogprobs | None], list[list[int]],
        list[list[TokenLogprobs] | None],
    ]:  # fmt: skip
        """Runs prompt chunks (writing their KV); samples the next token of the rows that ask for it. Returns the
        tokens, where a row asked for them log-probabilities per row (else empty), where the plan asks for
        drafts each row's (else empty) and, where a row asked for them, prompt log-probabilities per row
        (`RankResult.prefill_prompt_logprobs`, else empty)."""
        chunks = [SeqChunk(r.token_ids, r.start, r.page_ids) for r in rows]
        if self.model.two_batches:  # its tokens cut in half, a request's chunk cut where it falls
            halves = [
                None if not part else build_forward_batch(part, self.page_size, self.device, False)
                for part in split_chunks(chunks)
            ]
            hidden = self.model.forward_micro_batches(halves, self.cache)  # the rows in chunk order
            ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))
            last_rows = torch.tensor(ends, device=self.device) - 1  # each chunk's last token
        else:
            batch = build_forward_batch(chunks, self.page_size, self.device, decode=False)
            hidden = self.model(batch, self.cache)
            last_rows = batch.logits_indices
        prompt = self._prompt_logprobs(rows, hidden)
        sampled = [i for i, r in enumerate(rows) if r.sample is not None]
        out: list[int | None] = [None] * len(rows)
        out_logprobs: list[TokenLogprobs | None] = []
        if sampled:
            logits = self.model.compute_logits(hidden[last_rows[sampled]])
            specs = [rows[i].sample for i in sampled]
            request_ids = [rows[i].request_id for i in sampled]
            # the masks are filled on the host while the device runs the forward and the logits
            masks, errors = self.grammar.masks(request_ids, specs, self.device)
            tokens, logprobs = sample(logits, specs, request_ids, self.penalty_counts, masks)
            if masks is not None:
                self.grammar.accept(request_ids, specs, tokens, errors)
                self._row_errors.update(errors)
            for i, t in zip(sampled, tokens, strict=True):
                out[i] = t
            if logprobs is not None:
                out_logprobs = [None] * len(rows)
                for i, lp in zip(sampled, logprobs, strict=True):
                    out_logprobs[i] = lp
        drafts: list[list[int]] = []
        if plan.mtp:
            proposed = self.drafter.after_prefill(rows, hidden, out, plan.num_drafts)
            for request_id, q in proposed.probs.items():
                self.draft_probs.put(request_id, q)
            if plan.num_drafts:
                drafts = proposed.tokens
        return out, out_logprobs, drafts, prompt

    def _prompt_logprobs(
        self, rows: Sequence[PrefillRow], hidden: torch.Tensor
    ) -> list[list[TokenLogprobs] | None]:
        """Per row, where any row asks (else empty): the log-probabilities of the prompt tokens after its
        positions (`PrefillRow.prompt_logprobs`), None for a row that asks none. Logits are made
        `PROMPT_LOGITS_ROWS` positions at a time, so that their memory stays bounded whatever the chunk."""
        if all(r.prompt_logprobs == NO_LOGPROBS for r in rows):
            return []
        out: list[list[TokenLogprobs] | None] = [None] * len(rows)
        at = 0
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            if r.prompt_logprobs != NO_LOGPROBS:
                targets = list(r.token_ids[1:])
                if r.prompt_next is not None:
                    targets.append(r.prompt_next)
                index = torch.tensor(targets, dtype=torch.long).to(self.device, non_blocking=True)
                parts = []  # per block: the tensors of `target_logprobs`, read back once at the end
                for lo in range(0, len(targets), PROMPT_LOGITS_ROWS):
                    hi = min(lo + PROMPT_LOGITS_ROWS, len(targets))
                    logits = self.model.compute_logits(hidden[at + lo : at + hi])
                    parts.append(target_logprobs(logits, index[lo:hi], r.prompt_logprobs))
                out[i] = (
                    to_token_logprobs(*map(torch.cat, zip(*parts, strict=True))) if parts else []
                )
            at += n
        return out

    def _decode(
        self, rows: Sequence[DecodeRow], key: tuple[int, int] | None, plan: StepPlan, chain: int
    ) -> tuple[list[int], list[TokenLogprobs | None], list[int], list[list[int]]]:
        """One decode token per row (in CUDA-graph bucket `key` when given), verify groups verified; returns
        each row's token, where a row asked for them log-probabilities per row (else empty), where the step
        verified drafts each row's accepted count (`RankResult.decode_accepted`, else empty) and where the plan
        asks for drafts each row's (else empty). chain: the MTP passes after the first (`MTPDrafter`)."""
        chunks = [SeqChunk([r.token_id], r.position, r.page_ids) for r in rows]
        batch = build_forward_batch(chunks, self.page_size, self.device, decode=True)
        if self.graphs is not None:
            hidden, logits = self.graphs.forward(batch, key)
        else:
            hidden = self.model(batch, self.cache)
            logits = self.model.compute_logits(hidden)
        specs, request_ids = [r.sample for r in rows], [r.request_id for r in rows]
        # the masks are filled on the host while the device runs the forward (a graph replay)
        drafts = ()
        if any(r.drafts for r in rows):
            drafts = [
                [rows[i + j].token_id for j in range(1, r.drafts + 1)] for i, r in enumerate(rows)
            ]
        masks, errors = self.grammar.masks(request_ids, specs, self.device, drafts)
        if not plan.mtp or not plan.num_drafts:
            tokens, logprobs = sample(logits, specs, request_ids, self.penalty_counts, masks)
            if masks is not None:
                self.grammar.accept(request_ids, specs, tokens, errors)
                self._row_errors.update(errors)
            return tokens, logprobs or [], [], []
        relaxed = (plan.relaxed_topk, plan.relaxed_delta) if plan.relaxed_topk else None
        verified = self.drafter.verify(
            logits, rows, self.penalty_counts, self.draft_probs, relaxed, masks
        )
        if masks is not None:  # each group's kept tokens, on its first row
            self.grammar.accept(request_ids, specs, verified.tokens, errors, verified.accepted)
            self._row_errors.update(errors)
        graph_key = None
        if self.graphs is not None and not self._joins_idle:
            graph_key = self.graphs.last_key
            if self.drafter.graphs is None:
                self.drafter.graphs = DraftGraphs(
                    self.model, self.cache, self.graphs, self.drafter.depth_module
                )
        proposed = self.drafter.after_decode(
            rows, hidden, verified, plan.num_drafts, chain, graph_key
        )
        for request_id, q in proposed.probs.items():
            self.draft_probs.put(request_id, q)
        accepted = verified.accepted if any(r.drafts for r in rows) else []
        drafts = proposed.tokens if plan.num_drafts else []
        return verified.tokens, verified.logprobs or [], accepted, drafts
