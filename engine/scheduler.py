"""`Scheduler`: the one scheduling core every role runs. Pure Python (no torch): it decides, the runner executes.

One set of queues over one kind of record (`Request`): the arrival-ordered table of live requests, the queue of
those waiting for pages, and the transfers expected from prefill workers. A request's `Policy` picks its path
(prefill-only for a prefill worker, decode-only or aggregated for a decode worker, aggregated for the offline
path). A step is `schedule()` -> `StepPlan` -> the runner's `RankResult`s -> `finish_step()`:

- waiting requests take their pages in arrival order, the head of the queue blocking the rest; with the prefix
  cache (`prefix_caching`) a prefilled request first takes a reference to the cached pages its prompt starts
  with and its prefill starts after them, and the full pages its prefill computes are cached as they are
  (`PrefixCache`); on a decode worker (`reuse_held`) a decode-only request likewise starts from the cached
  pages of its first tokens, which its transfer then does not carry, and the pages of the KV that arrives and
  of finished requests stay cached; a request's references go with its pages (finished, aborted, failed,
  preempted), the pages staying cached; with a host tier (`host_slots`) the cached pages evicted go to the
  rank's host pool and a prompt that goes on past its GPU hit into pages stored there gets them copied back,
  the copies running before the next plan's passes (`StepPlan.host_copies`, `pdserve.engine.host_tier`);
- prefilling requests get chunks under the step's token budget, first come first served (`plan_prefill_chunks`);
- running requests each run one decode token, oldest first; one that needs a page nobody has free preempts the
  most recently admitted requests (their pages freed; an aggregated one is prefilled again later with the tokens
  generated so far, a decode-only one is handed back to the router), or is preempted itself; in batch-invariant
  mode a request that comes back with generated tokens prefills its prompt and replays those tokens as decode
  rows (`replay_generated`);
- with speculation (`num_drafts`), a running request's drafts from the step before run as rows after its token
  (a verify group), as many as `SpecPolicy` lets the step draft and its rank has rows for; its pages cover the
  drafts' rows and the MTP chain's positions ahead of its tokens (`lookahead`);
- after the step, sampled tokens are appended (a verify group's kept tokens, up to the first that stops it) and
  the stop rules applied.

Pages freed while a step is in flight (an abort from another thread) are held back until `finish_step`, since
the step's forward passes may still write them.

A worker of several ranks: with one page allocator per rank (data-parallel attention) each admitted request is
assigned to one rank (the one with the fewest KV pages in use less the request's pages cached there, then the
fewest requests: `rank_choice`) and lives there: its
pages come from that rank's allocator, its chunks count against that rank's token budget, preemption takes
victims of that rank only, and the plan has one `RankStep` per rank (empty for an idle rank). With one allocator
and several ranks (tensor-parallel attention: the latent cache is the same on every rank) every rank gets the
same `RankStep`, and rank 0's result is taken.

One file past 500 lines on purpose: admission, planning, preemption and applying results all read and write one
request table and one set of allocators under the invariants above (a request's pages come from its rank's
allocator, pages freed mid-step are held back); split, each part would reach into the others' state."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence

from pdserve.engine.checks import check_context, check_pages, check_token_ids
from pdserve.engine.chunking import plan_prefill_chunks
from pdserve.engine.host_tier import HostCopy, HostPool
from pdserve.engine.messages import RequestOutput, StageTimes
from pdserve.engine.pages import PageAllocator, pages_needed
from pdserve.engine.prefix_cache import CacheEventLog, PrefixCache
from pdserve.engine.rank_choice import pick_rank
from pdserve.engine.request import Policy, Request, RequestState, stage_times, think_state
from pdserve.engine.sampling_params import (
    MAX_PROMPT_LOGPROBS,
    FinishReason,
    TokenLogprobs,
    check_stop,
)
from pdserve.engine.spec_policy import SpecPolicy, SpecStats
from pdserve.engine.step import (
    MAX_DRAFTS,
    MAX_GRAPH_ROWS,
    NO_LOGPROBS,
    DecodeRow,
    PrefillRow,
    RankResult,
    RankStep,
    SampleSpec,
    StepPlan,
)
from pdserve.model.errors import CapacityError, InvalidRequestError
from pdserve.model.parallel import rows_per_rank

_REPLAY = SampleSpec(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, step=0)
"""A replayed token's row: greedy, nothing counted (its sample is dropped)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutcome:
    outputs: list[RequestOutput]
    """Tokens appended, finishes and aborts, in request order: this step's prefill rows, then its decode rows."""
    to_send: list[tuple[Request, int, TokenLogprobs | None]]
    """PREFILL_ONLY requests whose prefill ended this step, with their first token (and its log-probabilities
    where the request asked for them): the role exports their KV and then calls `release` (or `abort`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _InFlight:
    plan: StepPlan
    prefill: list[list[tuple[Request, int, int]]]
    """Per data-parallel rank: (request, start, length) per prefill row of its RankStep."""
    decode: list[list[Request]]
    """Per data-parallel rank: the request of each decode row."""
    host_held: list[list[int]] = dataclasses.field(default_factory=list)
    """Per data-parallel rank: the host slots the step's restores read (free after it)."""
    host_settling: list[set[int]] = dataclasses.field(default_factory=list)
    """Per data-parallel rank: pages of host copies issued before the step (`issue_host_copies`), done by
    the time it is."""


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator | Sequence[PageAllocator],
        page_size: int,
        token_budget: int,
        max_chunk: int,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Collection[int],
        max_running: int | None = None,
        fixed_chunks: bool = False,
        worker_kind: str = "worker",
        ranks: int | None = None,
        replay_generated: bool = False,
        num_drafts: int = 0,
        spec_policy: SpecPolicy | None = None,
        relaxed: tuple[int, float] | None = None,
        prefix_caching: bool = False,
        host_slots: int = 0,
        reuse_held: bool = False,
    ):
        """allocator: the KV pages of the worker's one rank, or one allocator per data-parallel rank (of equal
        sizes); ranks: ranks of the worker (default: one per allocator; with one allocator and more ranks, each
        rank runs the same rows); token_budget, max_chunk: prompt tokens per step (per rank), and per request
        per step; max_running: requests admitted at once (None: no limit); fixed_chunks (batch-invariant mode):
        cut prompts only at multiples of the chunk size (`plan_prefill_chunks`); worker_kind: how refusals name
        this worker ("decode worker"); replay_generated (batch-invariant mode): an aggregated request that
        carries generated tokens (preempted, or moved here from a lost worker) prefills its prompt alone and
        runs its generated tokens again as decode rows, so every token's KV comes from the phase that made
        it the first time (`_prefill_end`); num_drafts: the MTP module's draft tokens a step (0: no
        speculation): every plan runs MTP (`StepPlan.mtp`) and a running request with drafts verifies them as
        rows after its token (`DecodeRow.drafts`), as many as its rank has rows to spare under
        `max_rows`; spec_policy: when a step drafts (`SpecPolicy`; default: every step); relaxed: (top-k,
        delta) of relaxed acceptance for the requests that opt in (`SamplingParams.relaxed_think_ids`),
        inside their think blocks (None: strict acceptance for every request); prefix_caching: prefilled
        requests (prefill-only, aggregated) share the full pages of their prefill through each allocator's
        prefix cache and start their prefill after the pages they find there (`PrefixCache`); host_slots: with
        the prefix cache, pages of each rank's host pool (`HostPool`: evicted cached pages are stored there,
        and a prompt that goes on past its GPU hit into stored pages has them copied back; 0: off);
        reuse_held (a decode worker, with prefix_caching): the pages of a decode-only request's KV as they
        arrive, and a finished request's pages (`_cache_finished`), stay in the prefix cache, and a
        decode-only request starts from the cached pages of its first tokens (`PrefixCache.held_match`),
        referenced at once: its transfer carries only the pages after them (`Request.num_held_pages`)."""
        allocators = [allocator] if isinstance(allocator, PageAllocator) else list(allocator)
        ranks = len(allocators) if ranks is None else ranks
        if not allocators or len(allocators) not in (1, ranks):
            raise ValueError(
                f"{len(allocators)} page allocators for ranks={ranks}: expected 1 or {ranks}"
            )
        if len({a.num_pages for a in allocators}) != 1:
            raise ValueError(
                f"page allocators of unequal sizes {[a.num_pages for a in allocators]}"
            )
        self.allocators, self.ranks, self.page_size = allocators, ranks, page_size
        self.token_budget, self.max_chunk, self.fixed_chunks = token_budget, max_chunk, fixed_chunks
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_running, self.worker_kind = max_running, worker_kind
        self.rank_max_running = rows_per_rank(max_running, len(allocators))
        """Requests one data-parallel rank holds at most: max_running shared evenly, so that no rank runs more
        rows than the decode graphs its warm-up captured."""
        self.replay_generated = replay_generated
        if not 0 <= num_drafts <= MAX_DRAFTS:
            raise ValueError(f"num_drafts={num_drafts}: must be in [0, {MAX_DRAFTS}]")
        self.num_drafts = num_drafts
        self.max_rows = None
        """Decode rows one rank runs in a step at most, drafts' rows included: `rank_max_running` requests
        with their drafts, within the largest CUDA-graph bucket (past it a request verifies fewer drafts, so
        that the step stays a captured shape). None: no limit."""
        if self.rank_max_running is not None:
            self.max_rows = min(MAX_GRAPH_ROWS, self.rank_max_running * (1 + num_drafts))
            self.max_rows = max(self.max_rows, self.rank_max_running)
        self.lookahead = 2 * num_drafts
        """Positions past a running request's tokens its pages cover: its drafts' rows, then the MTP chain's."""
        self.spec_stats = SpecStats(num_drafts)
        self.spec_policy = spec_policy or SpecPolicy(num_drafts)
        if relaxed is not None and (relaxed[0] < 0 or relaxed[1] < 0):
            raise ValueError(f"relaxed={relaxed}: top-k and delta must be >= 0")
        self.relaxed = relaxed if relaxed is not None and relaxed[0] > 0 else None
        self.prefix_cache: PrefixCache | None = None
        self.cache_events: CacheEventLog | None = None
        """The pages cached and evicted since the router last heard (with the prefix cache)."""
        if prefix_caching:
            align = min(max_chunk, token_budget) if fixed_chunks else 1
            self.prefix_cache = PrefixCache(
                page_size, lookahead=num_drafts > 0, align=align,
                separate_received=fixed_chunks and reuse_held,
            )  # fmt: skip
            self.cache_events = CacheEventLog()
            for a in self.allocators:
                a.events = self.cache_events
        self.reuse_held = reuse_held and self.prefix_cache is not None
        self.num_held_pages = 0
        """Pages of decode-only requests found cached here, since start: pages their transfers did not carry."""
        self.host_pools: list[HostPool] = []
        if host_slots < 0:
            raise ValueError(f"host_slots={host_slots}: must be >= 0")
        if host_slots and self.prefix_cache is not None:
            self.host_pools = [HostPool(host_slots) for _ in allocators]
            for a, pool in zip(allocators, self.host_pools, strict=True):
                a.on_evict = pool.offload
                pool.events = self.cache_events
        self.issue_host_copies: Callable[[int, list[HostCopy]], None] | None = None
        """Where set (a worker of one rank: its runner's `HostKVStore.issue`), the host copies go to it as
        soon as `add` or `schedule` decides them, with the rank, so that they run while the step in flight
        runs (`pdserve.engine.host_tier`); else each plan carries those decided before it
        (`StepPlan.host_copies`)."""
        self._unsettled: list[set[int]] = [set() for _ in self.host_pools]
        """Per rank: pages of the copies issued since the last plan (running, maybe)."""
        self._step_drafts = num_drafts
        """The drafts the step being planned proposes (`SpecPolicy.drafts_for_step`)."""
        self.requests: dict[str, Request] = {}
        """Every live request, in arrival order."""
        self.waiting: deque[Request] = deque()
        """WAITING requests, in the order they take pages."""
        self._by_transfer: dict[int, Request] = {}
        self.num_preemptions = 0
        self._arrivals = itertools.count()
        self._transfer_ids = itertools.count(1)
        self._step_ids = itertools.count()
        self._in_flight: _InFlight | None = None

    @property
    def allocator(self) -> PageAllocator:
        """Rank 0's page allocator (the only one unless attention is data-parallel)."""
        return self.allocators[0]

    @property
    def num_used_pages(self) -> int:
        return sum(a.num_used for a in self.allocators)

    @property
    def num_pages(self) -> int:
        """Pages of every rank's allocator together."""
        return sum(a.num_pages for a in self.allocators)

    def _pick_rank(self, num_pages: int) -> int | None:
        """The data-parallel rank a new request goes to: of those with `num_pages` free and fewer requests than
        `rank_max_running`, the fewest pages in use, then the fewest requests, then the lowest rank; None when
        no rank has room."""
        return self._pick(lambda d: self.allocators[d].can_allocate(num_pages))

    def _pick(
        self, fits, hits: Sequence[int] | None = None, host_hits: Sequence[int] | None = None
    ) -> int | None:
        """The rank among those d where fits(d) by `rank_choice.pick_rank`: the fewest pages in use less the
        request's pages cached there (`hits`, per rank) and, at a lower weight, those after them in its host
        pool (`host_hits`), then the fewest requests."""
        if len(self.allocators) == 1:
            return 0 if fits(0) else None
        counts = [0] * len(self.allocators)
        for r in self.requests.values():
            counts[r.rank] += 1
        used = [a.num_used for a in self.allocators]
        hits = hits if hits is not None else [0] * len(used)
        return pick_rank(used, counts, hits, fits, self.rank_max_running, host_hits)

    def _fit(self, request: Request) -> tuple[int, list[int]] | None:
        """Where the request's pages come from now: the rank (`_pick_rank`'s choice among those with room for
        what it does not find cached there) and the cached pages it starts from there; None when no rank has
        room."""
        need = pages_needed(request.num_tokens, self.page_size)
        cache = self.prefix_cache
        host_hits: list[int] | None = None
        if request.policy is Policy.DECODE_ONLY and cache is not None and self.reuse_held:
            # the pages held here stand in for the transfer's first pages (`PrefixCache.held_match`)
            matched = [cache.held_match(request, a) for a in self.allocators]
        elif cache is None or request.policy is Policy.DECODE_ONLY or _scores_prompt(request):
            # a request scoring its prompt computes every position: the cache serves it nothing
            rank = self._pick_rank(need)
            return None if rank is None else (rank, [])
        else:
            end = self._prefill_end(request)
            matched = [cache.match(request, a, end) for a in self.allocators]
            if self.host_pools and len(self.allocators) > 1:  # what each rank would restore
                host_hits = [
                    len(cache.host_match(request, pool, end, len(m)))
                    for pool, m in zip(self.host_pools, matched, strict=True)
                ]

        def fits(d: int) -> bool:
            a, m = self.allocators[d], matched[d]
            return need - len(m) + a.cost(m) <= a.num_free

        rank = self._pick(fits, [len(m) for m in matched], host_hits)
        return None if rank is None else (rank, matched[rank])

    def _give_pages(self, request: Request, rank: int, cached: list[int]) -> None:
        """Gives the request its pages on `rank`: `cached` (a match there), then new ones; its prefill starts
        after the cached ones."""
        allocator = self.allocators[rank]
        allocator.take(cached)
        need = pages_needed(request.num_tokens, self.page_size) - len(cached)
        stored: list[bytes] = []  # the pages after the GPU hit that come back from the host pool
        slots: list[int] = []
        if (
            self.host_pools
            and request.policy is not Policy.DECODE_ONLY
            and not _scores_prompt(request)
        ):
            pool = self.host_pools[rank]  # (a request scoring its prompt computes every position)
            stored = self.prefix_cache.host_match(
                request, pool, self._prefill_end(request), len(cached)
            )
            slots = pool.take(stored)  # before allocate, whose evictions may store pages
        request.rank = rank
        if self.host_pools and request.policy is Policy.DECODE_ONLY:
            new = self._transfer_pages(rank, need)
        else:
            new = allocator.allocate(need)
        for h, slot, page in zip(stored, slots, new, strict=False):  # new: at least as many
            self.host_pools[rank].restore(slot, page)
            allocator.cache(page, h)
        request.pages = cached + new
        request.num_computed = (len(cached) + len(stored)) * self.page_size
        request.num_cached_pages = len(cached) + len(stored)
        if request.policy is Policy.DECODE_ONLY:  # its cached_tokens come from its prefill worker
            request.num_held_pages = len(cached)
            self.num_held_pages += len(cached)
        elif self.prefix_cache is not None and request.num_cached_tokens is None:
            self.prefix_cache.count(request, request.num_computed)

    def _transfer_pages(self, rank: int, need: int) -> list[int]:
        """`need` pages for a KV transfer to write (outside any step), with the host tier on: the cached pages
        evicted for them are not stored, and where one has a host copy pending, issued and maybe running, or
        in the step in flight (`HostPool`), they are given back and CapacityError raised (busy for now)."""
        allocator, pool = self.allocators[rank], self.host_pools[rank]
        allocator.on_evict = pool.drop
        try:
            pages = allocator.allocate(need)
        finally:
            allocator.on_evict = pool.offload
        busy = pool.busy_pages() | self._unsettled[rank]
        if self._in_flight is not None and self._in_flight.plan.host_copies:
            busy |= {c.page for c in self._in_flight.plan.host_copies[rank]}
        if self._in_flight is not None and self._in_flight.host_settling:
            busy |= self._in_flight.host_settling[rank]
        if busy.intersection(pages):
            allocator.free(pages)
            raise CapacityError(f"{self.worker_kind}: KV pages busy with host-tier copies, retry")
        return pages

    # Admission.

    def check(self, request: Request) -> None:
        """Raises InvalidRequestError naming the field, or CapacityError, when the request can never run here."""
        if request.request_id in self.requests:
            taken = "queued" if request.policy is Policy.PREFILL_ONLY else "running"
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already {taken}")
        check_token_ids(request.token_ids, self.vocab_size, "prompt_token_ids")
        if request.params.prompt_logprobs is not None:
            if self.ranks > 1:
                raise InvalidRequestError(
                    "prompt_logprobs", f"not supported on a {self.worker_kind} of several ranks yet"
                )
            entries = request.num_prompt_tokens * (1 + request.params.prompt_logprobs)
            if entries > MAX_PROMPT_LOGPROBS:
                raise InvalidRequestError(
                    "prompt_logprobs",
                    f"{request.num_prompt_tokens} prompt tokens with "
                    f"{request.params.prompt_logprobs} alternatives each exceed the "
                    f"{MAX_PROMPT_LOGPROBS} entries a request may ask for "
                    "(prompt tokens x (1 + alternatives))",
                )
        holder = f"this {self.worker_kind}"
        if request.policy is Policy.PREFILL_ONLY:
            check_pages(request.num_tokens, self.page_size, self.allocator.num_pages, holder)
            return
        max_tokens = request.params.max_tokens
        check_context(request.num_prompt_tokens, max_tokens, self.max_model_len)
        need = request.num_prompt_tokens + max_tokens + self.lookahead
        check_pages(need, self.page_size, self.allocator.num_pages, holder)

    @property
    def num_active(self) -> int:
        return len(self.requests)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a request with `num_tokens` known tokens would get its pages now."""
        return (
            (self.max_running is None or self.num_active < self.max_running)
            and not self.waiting
            and self._pick_rank(pages_needed(num_tokens, self.page_size)) is not None
        )

    def add(self, request: Request) -> None:
        """Admits a request. PREFILL_ONLY: queued, pages taken when it reaches the head of the queue. Otherwise
        its known tokens' pages are taken now (CapacityError when not free now) and, DECODE_ONLY, it gets a
        `transfer_id` for the prefill worker's transfer."""
        self.check(request)
        if request.policy is Policy.PREFILL_ONLY:
            request.state = RequestState.WAITING
            self.waiting.append(request)
        else:
            full = self.max_running is not None and self.num_active >= self.max_running
            fit = None if full or self.waiting else self._fit(request)
            if fit is None:
                free = [a.num_free for a in self.allocators]
                raise CapacityError(
                    f"{self.worker_kind} full: {'/'.join(map(str, free))} free KV pages, "
                    f"{self.num_active}/{self.max_running} requests"
                )
            self._give_pages(request, *fit)
            if request.policy is Policy.DECODE_ONLY:
                request.state = RequestState.WAITING_FOR_KV
                request.transfer_id = next(self._transfer_ids)
                self._by_transfer[request.transfer_id] = request
            else:
                request.state = RequestState.PREFILLING
        request.admit_order = next(self._arrivals)
        request.added_at = time.monotonic()
        self._flush_host_copies()
        think_ids = request.params.relaxed_think_ids
        if think_ids is not None:
            request.in_think = think_state(False, request.token_ids, think_ids)
        self.requests[request.request_id] = request

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens not yet prefilled (the router's load measure for a prefill worker)."""
        return sum(
            self._prefill_end(r) - r.num_computed
            for r in self.requests.values()
            if r.state in (RequestState.WAITING, RequestState.PREFILLING)
        )

    # Events.

    def kv_arrived(
        self, transfer_id: int, num_tokens: int, first_token: int,
        logprobs: TokenLogprobs | None = None, prefill_stages: StageTimes | None = None,
        draft_ids: Sequence[int] = (), cached_tokens: int | None = None,
        prompt_logprobs: list[TokenLogprobs] | None = None,
    ) -> list[RequestOutput]:  # fmt: skip
        """A DECODE_ONLY request's KV is in the cache, with the first token its prefill worker sampled, that
        token's log-probabilities (where asked), the stages that worker ran and the transfer took, the
        prompt tokens it found in its prefix cache and its prompt log-probabilities (where asked): its output
        carries them all."""
        request = self._by_transfer.pop(transfer_id, None)
        if request is None or request.state is not RequestState.WAITING_FOR_KV:
            return []
        if num_tokens != request.num_tokens:
            return self._abort(
                request, f"KV for {num_tokens} tokens arrived, expected {request.num_tokens}"
            )
        request.num_computed = num_tokens
        request.state = RequestState.RUNNING
        if self.reuse_held:  # the rows a prefill made: final (decode rows go after them)
            self.prefix_cache.register_upto(
                request, self.allocators[request.rank], num_tokens, first_token
            )
        request.first_token_at = time.monotonic()
        request.prefill_stages = prefill_stages
        request.num_cached_tokens = cached_tokens
        request.prompt_logprobs = prompt_logprobs
        outputs = self._append(request, [first_token], [logprobs], with_stages=True)
        request.draft_ids = list(draft_ids[: self.num_drafts])
        return outputs

    def kv_failed(self, transfer_id: int, error: str) -> list[RequestOutput]:
        request = self._by_transfer.pop(transfer_id, None)
        if request is None or request.state is not RequestState.WAITING_FOR_KV:
            return []
        return self._abort(request, error)

    def abort(self, request_id: str, error: str | None = None) -> list[RequestOutput]:
        """Forgets a request in any state and frees its pages; its output says finish_reason=abort."""
        request = self.requests.get(request_id)
        return [] if request is None else self._abort(request, error)

    def release(self, request_id: str) -> None:
        """A SENDING request's export is over: it is finished here and its pages are freed."""
        request = self.requests.get(request_id)
        if request is not None:
            self._release(request, RequestState.FINISHED)

    def _abort(self, request: Request, error: str | None) -> list[RequestOutput]:
        self._release(request, RequestState.ABORTED)
        spec = request.spec_counts()
        return [RequestOutput(request.request_id, [], FinishReason.ABORT, error, spec=spec)]

    def _release(self, request: Request, state: RequestState) -> None:
        if state is RequestState.FINISHED and self.reuse_held:
            self._cache_finished(request)
        request.state = state
        self.allocators[request.rank].free(request.pages[::-1])  # its prefix evicted last
        request.pages = []
        self.requests.pop(request.request_id, None)
        self._by_transfer.pop(request.transfer_id, None)
        if request in self.waiting:
            self.waiting.remove(request)

    def _cache_finished(self, request: Request) -> None:
        """Caches a finished request's full pages whose rows a later request would compute alike: every
        computed position's, where decode rows make the rows a prefill would (to rounding); in batch-invariant
        mode (`fixed_chunks`: a decode row's KV differs in the last bits from a prefill's) and where the
        MTP module writes rows of positions ahead (speculation) only those a prefill made, cached already."""
        if request.policy is Policy.PREFILL_ONLY or self.fixed_chunks or self.num_drafts:
            return
        self.prefix_cache.register_upto(
            request, self.allocators[request.rank], request.num_computed
        )  # fmt: skip

    def _append(
        self, request: Request, tokens: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None] | None = None, with_stages: bool = False,
    ) -> list[RequestOutput]:  # fmt: skip
        """Appends `tokens` (one, or a verify group's kept tokens) up to the first that finishes the request;
        `logprobs`: each token's, where the request asked for them. The output carries the request's stages
        when it finishes, or when asked (`with_stages`). Clears the request's drafts (the caller sets the next
        ones)."""
        reason = None
        taken = 0
        think_ids = request.params.relaxed_think_ids
        for token in tokens:
            request.token_ids.append(token)
            request.num_generated += 1
            taken += 1
            if think_ids is not None:
                request.in_think = think_state(request.in_think, (token,), think_ids)
            reason = check_stop(
                request.params, token, request.num_generated, self.eos_token_ids, request.stop_ids
            )
            if reason is not None:
                break
        request.first_token_at = request.first_token_at or time.monotonic()
        request.draft_ids = []
        if reason is not None:
            self._release(request, RequestState.FINISHED)
        stages = stage_times(request) if reason is not None or with_stages else None
        wanted = request.params.logprobs is not None
        cached = None
        if not request.cached_reported and request.num_cached_tokens is not None:
            cached, request.cached_reported = request.num_cached_tokens, True
        prompt = None
        if request.prompt_logprobs is not None and not request.prompt_reported:
            # scored here, or arrived with its KV (not where it came back with generated tokens)
            prompt, request.prompt_reported = request.prompt_logprobs, True
        return [
            RequestOutput(
                request.request_id,
                list(tokens[:taken]),
                reason,
                logprobs=list((logprobs or [None] * taken)[:taken]) if wanted else None,
                stages=stages,
                spec=request.spec_counts() if reason is not None else None,
                num_cached_tokens=cached,
                prompt_logprobs=prompt,
            )  # fmt: skip
        ]

    # Steps.

    def schedule(self) -> tuple[StepPlan | None, list[RequestOutput]]:
        """The next step's plan (None when there is nothing to run) and the outputs planning produced
        (preempted decode-only requests). A plan must be finished (`finish_step`) before the next one."""
        assert self._in_flight is None, "the previous step is not finished"
        outputs: list[RequestOutput] = []
        self._take_pages_in_order()
        prefill: list[tuple[Request, int, int]] = []
        for rank in range(len(self.allocators)):  # each rank's token budget
            pending = [(r, r.num_computed, self._prefill_end(r)) for r in self.requests.values()
                       if r.state is RequestState.PREFILLING and r.rank == rank]  # fmt: skip
            prefill += plan_prefill_chunks(
                pending, self.token_budget, self.max_chunk, self.fixed_chunks
            )
        decode: list[Request] = []
        running = sorted(
            (r for r in self.requests.values() if r.state is RequestState.RUNNING),
            key=lambda r: r.admit_order,
        )
        for request in running:
            if request.state is not RequestState.RUNNING:
                continue  # preempted while making room for an earlier one
            allocator = self.allocators[request.rank]
            covered = min(request.num_tokens + self.lookahead, self.max_model_len)
            need = pages_needed(covered, self.page_size) - len(request.pages)
            while need > 0 and not allocator.can_allocate(need):
                victim = self._pick_victim(exclude=request, protected=decode)
                if victim is None:
                    break
                outputs.extend(self._preempt(victim))
                prefill = [c for c in prefill if c[0] is not victim]
            if need > 0 and not allocator.can_allocate(need):
                outputs.extend(self._preempt(request))
                continue
            if need > 0:
                request.pages.extend(allocator.allocate(need))
            decode.append(request)
        if self.replay_generated:
            decode = self._with_replay_rows(decode)
        self._step_drafts = self.spec_policy.drafts_for_step(
            max(Counter(r.rank for r in decode).values(), default=0)
        )
        drafts = self._plan_drafts(decode)
        if drafts:  # a row per draft after its request's, as `_rank_step` lays them out
            decode = [row for r in decode for row in [r] * (1 + drafts.get(id(r), 0))]
        if not prefill and not decode:
            self._flush_host_copies()
            return None, outputs
        by_rank = range(len(self.allocators))
        prefill_by_rank = [[c for c in prefill if c[0].rank == d] for d in by_rank]
        decode_by_rank = [[r for r in decode if r.rank == d] for d in by_rank]
        steps = [
            self._rank_step(p, d, drafts)
            for p, d in zip(prefill_by_rank, decode_by_rank, strict=True)
        ]
        if len(steps) < self.ranks:
            steps *= self.ranks  # the same rows on every rank
        mtp = self.num_drafts > 0
        topk, delta = self.relaxed or (0, 0.0)
        copies, held = [], []
        self._flush_host_copies()
        for pool in self.host_pools:
            c, h = pool.take_copies()
            copies.append(c)
            held.append(h)
        if len(copies) < self.ranks and copies:
            copies *= self.ranks  # the same copies on every rank
        plan = StepPlan(
            next(self._step_ids), steps, mtp, self._step_drafts, topk, delta, tuple(copies)
        )
        settling, self._unsettled = self._unsettled, [set() for _ in self.host_pools]
        self._in_flight = _InFlight(plan, prefill_by_rank, decode_by_rank, held, settling)
        for allocator in self.allocators:
            allocator.hold_frees()
        return plan, outputs

    def _flush_host_copies(self) -> None:
        """Hands the host copies decided so far to `issue_host_copies`, where set. The slots they read are
        free at once: a later copy that writes one runs after them (one ordered stream)."""
        if self.issue_host_copies is None:
            return
        for rank, pool in enumerate(self.host_pools):
            copies, held = pool.take_copies()
            if copies:
                self.issue_host_copies(rank, copies)
                self._unsettled[rank].update(c.page for c in copies)
            pool.release(held)

    def _with_replay_rows(self, decode: list[Request]) -> list[Request]:
        """`decode` with a row more for each further generated token a request replays, as many as its rank
        has rows to spare under `rank_max_running`: the rows of one request run at consecutive positions in one step,
        each writing its token's KV before any row of the layer reads the cache, so in batch-invariant mode
        they give the bits of one row a step (a moved stream's 32 sent tokens cost one step, not 32)."""
        if self.rank_max_running is None:
            return decode
        rows = Counter(r.rank for r in decode)
        extra: list[Request] = []
        for request in decode:
            spare = self.rank_max_running - rows[request.rank]
            more = min(spare, request.num_tokens - 1 - request.num_computed)
            if more > 0:
                extra += [request] * more
                rows[request.rank] += more
        if not extra:
            return decode
        return sorted(
            [*decode, *extra], key=lambda r: r.admit_order
        )  # stable: a request's rows together

    def _plan_drafts(self, decode: list[Request]) -> dict[int, int]:
        """How many of its drafts each running request verifies this step (by id(request); none while it
        replays): at most the tokens it may still generate after the step's first, and as many as its rank
        has rows to spare under `max_rows`, oldest first."""
        if not self._step_drafts:
            return {}
        rows = Counter(r.rank for r in decode)
        out: dict[int, int] = {}
        for request in decode:
            if not request.draft_ids or request.num_computed != request.num_tokens - 1:
                continue
            room = request.params.max_tokens - request.num_generated - 1
            room = min(room, self.max_model_len - request.num_tokens - 1)
            if self.max_rows is not None:
                room = min(room, self.max_rows - rows[request.rank])
            k = min(len(request.draft_ids), room)
            if k > 0:
                out[id(request)] = k
                rows[request.rank] += k
        return out

    def _sample_spec(self, request: Request) -> SampleSpec:
        """Its next row's sampling; the first since it came here (or was preempted) carries its sequence for
        the penalties and its constraint for the grammar, which the runner keeps on from then on."""
        params, step = request.params, request.num_generated
        banned = request.banned_ids(self.eos_token_ids) if step < params.min_tokens else None
        spec = SampleSpec.of(
            params, step, request.token_ids, self.eos_token_ids, request.counted, banned
        )  # fmt: skip
        request.counted = request.params.penalized or request.params.structured is not None
        return spec

    def _rank_step(
        self, prefill: Sequence[tuple[Request, int, int]], decode: Sequence[Request],
        drafts: dict[int, int],
    ) -> RankStep:  # fmt: skip
        now = time.monotonic()
        for request, _, _ in prefill:
            request.first_chunk_at = request.first_chunk_at or now
        for request in decode:
            request.first_decode_at = request.first_decode_at or now
        prefill_rows = []
        for request, start, length in prefill:
            end = start + length
            last = end == request.num_tokens  # not when its generated tokens replay next
            sample = self._sample_spec(request) if last else None
            chunk = request.token_ids[start:end]
            after = request.token_ids[end] if self.num_drafts and not last else None
            scored, prompt_next = NO_LOGPROBS, None
            if _scores_prompt(request):
                scored = request.params.prompt_logprobs
                prompt_next = request.token_ids[end] if end < request.num_prompt_tokens else None
            prefill_rows.append(
                PrefillRow(request.request_id, chunk, start, list(request.pages), sample, after,
                           scored, prompt_next)
            )  # fmt: skip
        decode_rows = []
        ahead: dict[str, int] = {}  # a request's rows so far (several while it replays)
        for r in decode:
            if id(r) in drafts and r.request_id in ahead:
                continue  # a draft's row: made with its group's first
            position = r.num_computed + ahead.get(r.request_id, 0)
            ahead[r.request_id] = ahead.get(r.request_id, 0) + 1
            pages = list(r.pages)
            if position < r.num_tokens - 1:  # a replayed token
                decode_rows.append(DecodeRow(r.request_id, r.token_ids[position], position, pages,
                                             _REPLAY))  # fmt: skip
                continue
            k = drafts.get(id(r), 0)
            spec = self._sample_spec(r)
            # relaxed acceptance judges a draft inside the request's think block (its state after the row)
            loose = k > 0 and self.relaxed is not None and r.params.relaxed_think_ids is not None
            inside = r.in_think
            if loose and inside:
                spec = dataclasses.replace(spec, relaxed=True)
            decode_rows.append(
                DecodeRow(r.request_id, r.token_ids[position], position, pages, spec, k)
            )
            for i in range(1, k + 1):
                step = r.num_generated + i
                banned = r.banned_ids(self.eos_token_ids) if step < r.params.min_tokens else None
                draft_spec = SampleSpec.of(
                    r.params, step, (), self.eos_token_ids, counted=True, banned_ids=banned
                )
                if loose:
                    inside = think_state(inside, (r.draft_ids[i - 1],), r.params.relaxed_think_ids)
                    if inside:
                        draft_spec = dataclasses.replace(draft_spec, relaxed=True)
                decode_rows.append(
                    DecodeRow(r.request_id, r.draft_ids[i - 1], position + i, pages, draft_spec)
                )
        return RankStep(prefill_rows, decode_rows)

    def _prefill_end(self, request: Request) -> int:
        """Where its prefill ends: every known token, or (replay_generated, an aggregated request with generated
        tokens) its prompt, its generated tokens then running as decode rows whose samples are dropped until
        the last (a token's KV differs in the last bits between the prefill and decode kernels: replayed, a
        moved or preempted stream goes on exactly as it would have)."""
        if self.replay_generated and request.num_generated and request.policy is Policy.AGGREGATED:
            return request.num_prompt_tokens
        return request.num_tokens

    def _take_pages_in_order(self) -> None:
        while self.waiting:
            request = self.waiting[0]
            fit = self._fit(request)
            if fit is None:
                return
            self._give_pages(request, *fit)
            request.state = RequestState.PREFILLING
            self.waiting.popleft()

    def _pick_victim(self, exclude: Request, protected: list[Request]) -> Request | None:
        """The most recently admitted request holding pages of `exclude`'s rank, other than `exclude` and those
        already planned."""
        candidates = [r for r in self.requests.values() if r is not exclude and r not in protected
                      and r.rank == exclude.rank and r.pages
                      and r.state in (RequestState.RUNNING, RequestState.PREFILLING)]  # fmt: skip
        return max(candidates, key=lambda r: r.admit_order, default=None)

    def _preempt(self, request: Request) -> list[RequestOutput]:
        self.num_preemptions += 1
        self.allocators[request.rank].free(request.pages[::-1])  # its prefix evicted last
        request.pages = []
        request.num_computed = 0
        request.num_cached_pages = 0  # they stay in the cache, for its prefill again
        request.counted = False
        request.draft_ids = []
        if request.policy is Policy.DECODE_ONLY:
            self._release(request, RequestState.ABORTED)
            return [
                RequestOutput(request.request_id, [], preempted=True, spec=request.spec_counts())
            ]
        request.state = RequestState.WAITING
        self.waiting.append(request)
        return []

    def finish_step(self, plan: StepPlan, results: Sequence[RankResult]) -> StepOutcome:
        """Applies the ranks' results of `plan` (the last plan `schedule` returned). Rows of requests aborted
        while the step ran are skipped; a failed pass aborts its requests."""
        in_flight, self._in_flight = self._in_flight, None
        assert in_flight is not None and in_flight.plan.step_id == plan.step_id, (
            "not the step in flight"
        )
        for allocator in self.allocators:
            allocator.release_held()
        for pool, held in zip(self.host_pools, in_flight.host_held, strict=True):
            pool.release(held)
        assert len(results) == len(plan.ranks), (
            f"{len(results)} results for {len(plan.ranks)} ranks"
        )
        outputs: list[RequestOutput] = []
        to_send: list[tuple[Request, int, TokenLogprobs | None]] = []
        before = (self.spec_stats.drafted, self.spec_stats.accepted)
        # zip stops at the data-parallel ranks: with replicated rows rank 0's result is taken
        for prefill, decode, result in zip(
            in_flight.prefill, in_flight.decode, results, strict=False
        ):
            assert result.step_id == plan.step_id, "a result of another step"
            self._apply(prefill, decode, result, outputs, to_send)
        self.spec_policy.verified(
            self.spec_stats.drafted - before[0], self.spec_stats.accepted - before[1]
        )
        return StepOutcome(outputs, to_send)

    def _apply(
        self,
        prefill: list[tuple[Request, int, int]],
        decode: list[Request],
        result: RankResult,
        outputs: list[RequestOutput],
        to_send: list[tuple[Request, int, TokenLogprobs | None]],
    ) -> None:
        """Applies one rank's result to its rows, adding to `outputs` and `to_send`."""
        prefill_logprobs = result.prefill_logprobs or [None] * len(prefill)
        prefill_drafts = result.prefill_drafts or [[]] * len(prefill)
        prompt_logprobs = result.prefill_prompt_logprobs or [None] * len(prefill)
        for (request, start, length), token, logprobs, drafts, scored in zip(
            prefill, result.prefill_tokens or [None] * len(prefill), prefill_logprobs,
            prefill_drafts, prompt_logprobs, strict=True,
        ):  # fmt: skip
            if request.state is not RequestState.PREFILLING:
                continue  # aborted while the step ran
            if result.prefill_error is not None:
                outputs += self._abort(request, f"prefill failed: {result.prefill_error}")
                continue
            if request.request_id in result.row_errors:
                outputs += self._abort(request, result.row_errors[request.request_id])
                continue
            request.num_computed = start + length
            if scored is not None:  # entry i: the prompt token after position i
                request.prompt_logprobs = [*(request.prompt_logprobs or [])[:start], *scored]
            if self.prefix_cache is not None:
                self.prefix_cache.register(request, self.allocators[request.rank], token)
            if token is None:
                if request.num_computed == self._prefill_end(request) < request.num_tokens:
                    request.state = RequestState.RUNNING  # its generated tokens replay next
                continue
            if request.policy is Policy.PREFILL_ONLY:
                request.first_token_at = request.first_token_at or time.monotonic()
                request.state = RequestState.SENDING
                request.draft_ids = list(drafts)  # they go with its KV
                to_send.append((request, token, logprobs))
            else:
                request.state = RequestState.RUNNING
                outputs += self._append(request, [token], [logprobs])
                if request.state is RequestState.RUNNING:
                    request.draft_ids = list(drafts)
        n = len(decode)
        tokens = result.decode_tokens or [None] * n
        decode_logprobs = result.decode_logprobs or [None] * n
        accepted = result.decode_accepted or [1] * n
        decode_drafts = result.decode_drafts or [[]] * n
        for r, request in enumerate(decode):
            if request.state is not RequestState.RUNNING or not accepted[r]:
                continue  # finished or aborted while the step ran, or a draft's row
            if result.decode_error is not None:
                outputs += self._abort(request, f"decode failed: {result.decode_error}")
                continue
            if request.request_id in result.row_errors:
                outputs += self._abort(request, result.row_errors[request.request_id])
                continue
            kept = accepted[r]
            request.num_computed += kept
            if request.num_computed < request.num_tokens:
                continue  # a replayed token: its sample is dropped
            verified = r + 1 < n and decode[r + 1] is request and not accepted[r + 1]
            if verified:  # a verify group's first row
                drafted = self._group_size(decode, r) - 1
                request.num_drafted += drafted
                request.num_accepted += kept - 1
                request.num_verify_steps += 1
                self.spec_stats.count(drafted, kept - 1)
            outputs += self._append(
                request, tokens[r : r + kept], decode_logprobs[r : r + kept]
            )  # fmt: skip
            if request.state is RequestState.RUNNING:
                request.draft_ids = list(decode_drafts[r + kept - 1])

    @staticmethod
    def _group_size(decode: list[Request], r: int) -> int:
        """Rows of the verify group starting at row r (its request's rows up to the next of another)."""
        end = r + 1
        while end < len(decode) and decode[end] is decode[r]:
            end += 1
        return end - r


def _scores_prompt(request: Request) -> bool:
    """Whether its prefill computes its prompt log-probabilities: it asked for them, and has not had them (a
    request prefilled again with generated tokens reported them with its first token)."""
    return request.params.prompt_logprobs is not None and request.num_generated == 0
