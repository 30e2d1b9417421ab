"""`Worker`: what a prefill and a decode worker share. A model runner over the worker's paged KV cache, its page
allocator, the lock that control calls (any thread) and the loop thread take, running a step plan of the role's
scheduler (`pdserve.engine.scheduler`), and the loop: step while there is work, otherwise wait for a wake-up or
`idle_wait_s`. A role subclasses it with its scheduler's policy and its `step`.

A worker of several ranks (`config.layout.ranks` > 1) is given its running `RankGroup` (`rank_runner.start_rank_group`):
its runner is the driver's (rank 0's) shard, each plan runs on every rank through the group, and with
data-parallel attention it keeps one page allocator per rank. When the group fails (a rank died, stalled or
raised), every request of the worker fails with an error naming the rank, every page is freed, the ranks are
stopped and the loop raises `RanksFailedError`, ending the worker."""

from __future__ import annotations

import logging
import threading
import time

import torch

from pdserve.engine.messages import RANK_GROUP_FAILED, CacheEvents, RequestOutput
from pdserve.engine.pages import PageAllocator
from pdserve.engine.rank_memory import worker_reserve_bytes
from pdserve.engine.ranks.channel import PlanChannelError
from pdserve.engine.ranks.group import RankGroup, RankStepError
from pdserve.engine.ranks.wire import PageTableCache, plan_to_wire, result_from_wire
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler import Scheduler, StepOutcome
from pdserve.engine.step import RankResult, StepPlan
from pdserve.engine.step_timer import StepTimer
from pdserve.engine.warm_up import warm_up_plans
from pdserve.model.deepseek import Transformer
from pdserve.model.errors import ConfigError, PdserveError

logger = logging.getLogger(__name__)


def plan_shape(plan: StepPlan) -> str:
    """A plan's shape for a log line: per rank, its prompt chunks as tokens@start and its decode rows with the
    widest page table."""
    parts = []
    for rank, step in enumerate(plan.ranks):
        chunks = " ".join(f"{len(r.token_ids)}@{r.start}" for r in step.prefill) or "-"
        pages = max((len(r.page_ids) for r in step.decode), default=0)
        parts.append(
            f"rank {rank}: prefill [{chunks}], decode {len(step.decode)} rows <= {pages} pages"
        )
        if len(parts) == 4 and len(plan.ranks) > 4:
            parts.append(f"... {len(plan.ranks) - 4} more ranks")
            break
    return "; ".join(parts)


def prefix_cache_counts(scheduler: Scheduler) -> dict[str, int]:
    """A worker's stats' prefix-cache counters (`PrefillStats`, `DecodeStats`): tokens looked up and found, since
    start (0 with the cache off)."""
    cache = scheduler.prefix_cache
    if cache is None:
        return {"prefix_cache_queries": 0, "prefix_cache_hits": 0}
    return {"prefix_cache_queries": cache.num_queries, "prefix_cache_hits": cache.num_hits}


def prefix_cache_info(scheduler: Scheduler) -> dict[str, int | bool] | None:
    """What the router needs to hash a prompt as this worker's prefix cache does (`ready`): page_size,
    hit_unit and lookahead (`PrefixCache`), whether it holds received KV for later transfers
    (`Scheduler.reuse_held`) and the root of that KV's hash chains (hex); None with the cache off."""
    cache = scheduler.prefix_cache
    if cache is None:
        return None
    return {
        "page_size": cache.page_size, "hit_unit": cache.hit_unit, "lookahead": cache.lookahead,
        "reuse_held": scheduler.reuse_held, "held_root": cache.received_root.hex(),
    }  # fmt: skip


def host_tier_counts(worker: Worker) -> dict[str, int]:
    """The host tier's counters since start (0 with it off): pages stored and restored (host hits, in pages),
    evicted pages dropped for want of a free slot, and bytes copied either way (`HostKVStore`)."""
    pools = worker.scheduler.host_pools
    store = getattr(worker.runner, "host_store", None)
    return {
        "host_kv_offloaded_pages": sum(p.num_offloaded for p in pools),
        "host_kv_restored_pages": sum(p.num_restored for p in pools),
        "host_kv_dropped_pages": sum(p.num_dropped for p in pools),
        "host_kv_bytes_copied": store.bytes_copied if store is not None else 0,
    }


def expert_balance_counts(worker: Worker) -> dict[str, float]:
    """Expert balancing's counters since start (0 without spare expert slots): `ExpertBalancer`'s placements,
    moved slots and last balancedness (0.0 before the first placement)."""
    balancer = getattr(worker.model, "balancer", None)
    if balancer is None:
        return {}
    return {
        "expert_rebalances": balancer.rebalances,
        "expert_slots_moved": balancer.moved_slots,
        "expert_balancedness": balancer.balancedness or 0.0,
    }


class RanksFailedError(PdserveError):
    """A worker's rank group failed; the worker has failed its requests and cannot go on."""


class Worker:
    idle_wait_s = 0.05
    """Longest the loop sleeps with nothing to do when nothing wakes it."""
    slow_step_s = 1.0
    """A step that runs longer is logged (WARNING) with its shape: on a GPU after warm-up one usually means a
    shape the warm-up missed (a Triton compile or a graph capture in a client's request)."""

    def __init__(
        self, worker_id: str, model: Transformer | None, config, kv_cache_dtype: str = "auto",
        cuda_graphs: bool = True, ranks: RankGroup | None = None, runner: ModelRunner | None = None,
    ):  # fmt: skip
        """config: the role's config (page_size, num_pages, gpu_memory_fraction, cpu_cache_bytes, ranks,
        attention); kv_cache_dtype: auto or fp8 (`pdserve.model.kv_cache`), the same on both sides of a
        transfer; ranks: the worker's running rank group when it has several ranks (then `model` is unused:
        the driver's shard is rank 0's handler's); the worker closes it. runner: the runner to step instead
        of one sized for `model` (then `model` is unused): anything with ModelRunner's `model.args`,
        `num_pages`, `cache`, `device`, `graphs` and `execute`, e.g. the model-free tests' stand-in."""
        if runner is not None and ranks is not None:
            raise ValueError("a worker takes a runner or a rank group, not both")
        self.worker_id, self.config, self.ranks = worker_id, config, ranks
        if runner is not None:
            self.runner = runner
        elif ranks is None:
            self.runner = ModelRunner.sized(
                model,
                config.page_size,
                config.num_pages,
                config.gpu_memory_fraction,
                config.cpu_cache_bytes,
                cuda_graphs=cuda_graphs,
                kv_cache_dtype=kv_cache_dtype,
                reserve_bytes=worker_reserve_bytes(
                    model,
                    config.max_num_batched_tokens,
                    getattr(config, "max_running", None),
                    getattr(config, "num_speculative_tokens", 0),
                ),
                host_kv_cache_bytes=getattr(config, "host_kv_cache_bytes", 0),
            )
        else:
            if getattr(config, "host_kv_cache_bytes", 0):
                raise ConfigError(
                    f"host_kv_cache_bytes={config.host_kv_cache_bytes} with ranks={ranks.world_size}: "
                    "the host KV tier runs on workers of one rank only"
                )
            self.runner = ranks.handler.runner
        self.model = self.runner.model
        self.num_ranks = 1 if ranks is None else ranks.world_size
        num_allocators = 1 if ranks is None else config.layout.attention_dp_size
        self.allocators = [PageAllocator(self.runner.num_pages) for _ in range(num_allocators)]
        self.allocator = self.allocators[0]
        """Rank 0's pages (the worker's only allocator unless attention is data-parallel)."""
        self.failed: str | None = None
        """Why the worker's rank group failed (then the loop ends)."""
        self.scheduler: Scheduler
        """Set by the role (`_make_scheduler`), over `allocators`."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._page_tables = PageTableCache(self.runner.num_pages)
        """The page ids of the last plan sent to the ranks (the loop thread's)."""
        self.step_timer = StepTimer()
        """The step in flight and its expected duration, which the stats report (the router's step deadline)."""

    @property
    def num_pages(self) -> int:
        """KV pages of every data-parallel rank together."""
        return sum(a.num_pages for a in self.allocators)

    @property
    def num_used_pages(self) -> int:
        return sum(a.num_used for a in self.allocators)

    def step_timing(self) -> tuple[float, float]:
        """(seconds the step in flight has run, its expected seconds), as the stats report them."""
        return self.step_timer.current()

    def _make_scheduler(self, *args, **kwargs) -> Scheduler:
        """The role's scheduler over this worker's allocators and ranks (Scheduler's arguments after them)."""
        store = getattr(self.runner, "host_store", None)
        host = store.num_slots if store is not None else 0
        scheduler = Scheduler(
            self.allocators, *args, ranks=self.num_ranks, host_slots=host, **kwargs
        )
        if scheduler.host_pools:  # copies start when decided, overlapping the step in flight
            scheduler.issue_host_copies = lambda rank, copies: store.issue(copies)
        return scheduler

    def step(self) -> bool:
        """Runs one step of the role's work; False when there was nothing to do."""
        raise NotImplementedError

    def _run_plan(self, plan: StepPlan) -> StepOutcome:
        """Runs a plan the scheduler made (under the lock) without the lock, so control calls never wait for a
        forward pass, then applies its results under the lock. When the worker's rank group fails, every
        request fails (the outcome's outputs) and `failed` is set."""
        return self._run_round(plan)[0]

    def _run_round(
        self, plan: StepPlan | None, kv_control: list | None = None
    ) -> tuple[StepOutcome, list[list]]:
        """`_run_plan` for a worker whose ranks also take KV control (`pdserve.engine.ranks.kv`): runs one round
        of the plan (None: KV control alone) and returns its outcome and each rank's KV arrivals."""
        start = time.monotonic()
        if plan is not None:
            self.step_timer.started(plan)
        ran = False  # a step that failed tells nothing of the worker's speed
        try:
            if self.ranks is None:
                results = [self.runner.execute(plan)]
                arrivals: list[list] = []
            else:
                wire = None if plan is None else plan_to_wire(plan, self._page_tables)
                try:
                    replies = self.ranks.step([wire, kv_control])
                except (PlanChannelError, RankStepError) as e:  # a rank lost, stalled or raised
                    return self._fail_ranks(plan, e), []
                results = [] if plan is None else [result_from_wire(r[0]) for r in replies]
                arrivals = [r[1] for r in replies]
            ran = True
        finally:
            if plan is not None:
                self.step_timer.finished(plan, measure=ran)
        elapsed = time.monotonic() - start
        if elapsed > self.slow_step_s and plan is not None:
            logger.warning(
                "%s: step %d took %.2f s: %s",
                self.worker_id,
                plan.step_id,
                elapsed,
                plan_shape(plan),
            )
        if plan is None:
            return StepOutcome([], []), arrivals
        with self._lock:
            return self.scheduler.finish_step(plan, results), arrivals

    def cache_events(self) -> CacheEvents | None:
        """The prefix cache's and host tier's events since the last call (`CacheEventLog`), None when there
        are none."""
        with self._lock:
            log = self.scheduler.cache_events
            if not log:
                return None
            events = log.drain(self.scheduler.allocators, self.scheduler.host_pools)
        return CacheEvents(*events)

    def _fail_ranks(self, plan: StepPlan | None, error: Exception) -> StepOutcome:
        """Fails the step in flight and every other request, freeing their pages, and stops the ranks."""
        why = f"worker {self.worker_id}: {RANK_GROUP_FAILED}: {error}"
        logger.error("%s", why)
        self.failed = why
        with self._lock:
            outputs: list[RequestOutput] = []
            if plan is not None:
                failed = RankResult(plan.step_id, prefill_error=why, decode_error=why)
                outputs += self.scheduler.finish_step(plan, [failed] * len(plan.ranks)).outputs
            self._ranks_failed()
            for request_id in list(self.scheduler.requests):
                outputs += self.scheduler.abort(request_id, why)
        self.ranks.close()
        return StepOutcome(outputs, [])

    def _warm_up(
        self,
        prefill_tokens: int,
        decode_rows: int,
        decode_tokens: int,
        prefill_budget: int | None = None,
    ) -> None:
        """Runs `warm_up_plans` on every rank before the worker serves (GPU only: on the CPU nothing compiles).
        Raises RuntimeError naming the pass that failed."""
        if self.runner.device.type != "cuda":
            return
        start = time.monotonic()
        plans = warm_up_plans(
            self.num_ranks, self.config.page_size, self.runner.num_pages, prefill_tokens,
            decode_rows if self.runner.graphs is not None else 0, decode_tokens, prefill_budget,
            self.scheduler.num_drafts,
        )  # fmt: skip
        page_tables = PageTableCache(self.runner.num_pages)
        for plan in plans:
            if self.ranks is None:
                results = [self.runner.execute(plan)]
            else:
                wire = plan_to_wire(plan, page_tables)
                results = [result_from_wire(r[0]) for r in self.ranks.step([wire, None])]
            for rank, r in enumerate(results):
                if r.prefill_error or r.decode_error:
                    raise RuntimeError(
                        f"worker {self.worker_id}: warm-up failed on rank {rank}: "
                        f"{r.prefill_error or r.decode_error}"
                    )
        device = self.runner.device
        logger.info(
            "%s: warmed up in %.1f s (%d passes: prompt chunks up to %d tokens, %s tokens a pass, decode "
            "graphs up to %d rows x %d tokens); rank 0's peak %.2f GiB allocated of %.2f GiB",
            self.worker_id, time.monotonic() - start, len(plans), prefill_tokens,
            prefill_budget or prefill_tokens, decode_rows, decode_tokens,
            torch.cuda.max_memory_allocated(device) / 2**30,
            torch.cuda.get_device_properties(device).total_memory / 2**30,
        )  # fmt: skip

    def warm_up(self) -> None:
        """Compiles and captures every shape the role runs, before it serves (a role sizes `_warm_up`)."""
        raise NotImplementedError

    def _ranks_failed(self) -> None:
        """Under the lock, once the rank group failed: a role frees what it keeps for its ranks."""

    def close_ranks(self) -> None:
        """Stops the worker's other ranks (a role's `close` calls it); idempotent."""
        if self.ranks is not None:
            self.ranks.close()

    def run(self, stop: threading.Event) -> None:
        """The worker's loop: steps while there is work, waits for a wake-up otherwise, until `stop`."""
        while not stop.is_set():
            if self.failed is not None:
                raise RanksFailedError(self.failed)
            if not self.step():
                self._wake.wait(timeout=self.idle_wait_s)
                self._wake.clear()
