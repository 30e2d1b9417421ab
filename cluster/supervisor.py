"""The supervisor: keeps a record of every lost worker and starts a replacement in its place.

A worker is lost when a call to its actor raises Ray's actor-death errors (the router's polls and calls), when
it stalls (`check_heartbeats`: silent, or reporting a step that runs on, for `router.heartbeat_timeout_s` past
its step's deadline, which scales with the step: a long prefill chunk is not a hang), or when it reports that its
rank group failed (the router sees RANK_GROUP_FAILED in a request's error). The router then moves the worker's
requests elsewhere and calls `worker_lost` here, which kills what is left of the worker and starts a new one of
the same role and layout under a new name (so no KV link of the dead one is ever reused), warmed up like any
new worker. At most `router.max_restarts` replacements per role start within `router.restart_window_s`; past
that bound (a crash loop) lost workers of that role are not replaced, and `restarts_stopped` says why (in the
router's admission, for requests that find no decode worker, and in `pdserve status`). A worker that was draining is not
replaced: it was on its way out."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.pools import ROLES, Launcher, WorkerHandle, WorkerState
from pdserve.cluster.router import Router
from pdserve.cluster.scaling import Scaler

logger = logging.getLogger(__name__)

_MAX_RECORDS = 256
"""Lost workers remembered (the oldest are forgotten first)."""
_RETRY_S = 1.0
"""Pause before another try at a replacement whose start failed."""
WATCH_S = 0.25
"""Between checks of the workers' heartbeats."""
STEP_DEADLINE_FACTOR = 4.0
"""A step's deadline in multiples of the time its worker expects it to take (`pdserve.engine.step_timer`)."""
UNKNOWN_STEP_S = 60.0
"""The deadline of a step whose worker has not measured its speed yet (its first step)."""


@dataclasses.dataclass(eq=False)
class LostWorker:
    """The record of one lost worker."""

    worker: WorkerHandle
    reason: str
    lost_at: float
    """time.monotonic() when it was found lost."""
    replaced_by: str = ""
    """The replacement's worker id once it serves."""
    replacement_error: str = ""
    """Why the latest try at a replacement failed, if one did."""
    not_replaced: str = ""
    """Why no replacement will come (draining, or the restart bound), if none will."""


class Supervisor:
    """Runs on the router's event loop; installs itself as the router's `on_worker_lost`."""

    def __init__(self, config: RouterConfig, router: Router, scaler: Scaler, launcher: Launcher):
        self.config, self.router, self.scaler, self.launcher = config, router, scaler, launcher
        self.lost: collections.deque[LostWorker] = collections.deque(maxlen=_MAX_RECORDS)
        self.num_lost = 0
        self.num_replaced = 0
        self._restarts: dict[str, collections.deque[float]] = {
            role: collections.deque() for role in ROLES
        }
        self._stopped: dict[str, str] = {}
        """Per role, why its lost workers are no longer replaced (until its budget comes back)."""
        self._tasks: set[asyncio.Task] = set()
        router.on_worker_lost = self.worker_lost

    def worker_lost(self, w: WorkerHandle, reason: str, state: str) -> None:
        """Records the loss and, unless the worker was starting (its launch fails on its own), draining, or
        the role's restart budget is spent, starts its replacement in the background. The router counts the
        replacement as coming from this call on, so requests wait for it rather than fail."""
        self.num_lost += 1
        record = LostWorker(w, reason, time.monotonic())
        self.lost.append(record)
        if state == WorkerState.STARTING:
            record.not_replaced = "lost while starting"
        elif state == WorkerState.DRAINING:
            record.not_replaced = "it was draining"
        elif not self._may_restart(w.role):
            self._stop_restarts(record)
        else:
            self._set_stopped(w.role, None)
            self.router.admission.num_replacing[w.role] += 1
            self._spawn(self._replace(record))
            return
        self._spawn(self.launcher.stop(w, close=False))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Cancels replacements under way (a worker they started is stopped by the scaler)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    def _may_restart(self, role: str) -> bool:
        """Takes one restart from the role's budget; False when the window's budget is spent."""
        now, starts = time.monotonic(), self._restarts[role]
        while starts and starts[0] <= now - self.config.restart_window_s:
            starts.popleft()
        if len(starts) >= self.config.max_restarts:
            return False
        starts.append(now)
        return True

    def _stop_restarts(self, record: LostWorker) -> None:
        w = record.worker
        record.not_replaced = (
            f"restarts stopped: {len(self._restarts[w.role])} {w.role} workers were replaced within "
            f"{self.config.restart_window_s:g}s (router.max_restarts={self.config.max_restarts}); "
            f"{w.worker_id} was not (`pdserve scale` starts workers again)"
        )
        self._set_stopped(w.role, record.not_replaced)
        logger.error("%s", record.not_replaced)

    def _set_stopped(self, role: str, why: str | None) -> None:
        if why is None:
            self._stopped.pop(role, None)
        else:
            self._stopped[role] = why
        self.router.admission.restarts_stopped = "; ".join(self._stopped.values())

    async def _replace(self, record: LostWorker) -> None:
        """Starts the replacement (the first restart is already taken from the budget), trying again within
        the budget when a start fails."""
        w = record.worker
        try:
            await self.launcher.stop(w, close=False)
            while not self.router.closed:
                logger.warning("starting a replacement for %s", w.worker_id)
                try:
                    (new,) = await self.scaler.add(w.role, 1)
                except Exception as e:  # task boundary: try again within the restart bound
                    record.replacement_error = f"{type(e).__name__}: {e}"
                    logger.error("replacement for %s failed: %s", w.worker_id, e, exc_info=True)
                    await asyncio.sleep(_RETRY_S)
                    if not self._may_restart(w.role):
                        self._stop_restarts(record)
                        return
                    continue
                record.replaced_by = new.worker_id
                self.num_replaced += 1
                logger.warning(
                    "%s replaces %s (lost %.1fs ago: %s)", new.worker_id, w.worker_id,
                    time.monotonic() - record.lost_at, record.reason,
                )  # fmt: skip
                return
        finally:
            self.router.admission.num_replacing[w.role] -= 1

    def check_heartbeats(self) -> None:
        """Declares lost every worker that stalls past its step deadline (`stall_reason`)."""
        now = time.monotonic()
        for w in list(self.router.workers.values()):
            if w.state != WorkerState.DEAD and (why := stall_reason(w, now, self.config)):
                self.router.worker_lost(w, why)

    async def watch(self) -> None:
        """Runs `check_heartbeats` every WATCH_S until cancelled. A round that wakes late (this loop was held:
        answers that came meanwhile may not be processed yet) is skipped, so a busy router never takes its
        own delay for the workers' silence."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            if now - last < 2 * WATCH_S:
                self.check_heartbeats()
            last = now


def step_deadline_s(w: WorkerHandle) -> tuple[float, float]:
    """(seconds the worker's step in flight had run at its latest stats, that step's deadline in seconds from
    its start); (0.0, 0.0) between steps. The deadline is STEP_DEADLINE_FACTOR times the step's expected
    seconds, or UNKNOWN_STEP_S before the worker has measured its speed."""
    stats = w.stats
    if stats is None or stats.step_s <= 0:
        return 0.0, 0.0
    expected = stats.step_expected_s
    return stats.step_s, STEP_DEADLINE_FACTOR * expected if expected > 0 else UNKNOWN_STEP_S


def stall_reason(w: WorkerHandle, now: float, config: RouterConfig) -> str | None:
    """Why the worker counts as stalled at `now`, or None. Stalled: silent (no answer to a stats call or a
    long-poll) for router.heartbeat_timeout_s past the deadline of the step it was running at its latest
    stats, or reporting a step that runs router.heartbeat_timeout_s past its deadline."""
    if not w.last_heartbeat:
        return None
    grace = config.heartbeat_timeout_s
    ran, deadline = step_deadline_s(w)
    if ran > deadline + grace:
        return (
            f"its step has run {ran:.1f}s, past its deadline of {deadline:.1f}s "
            f"(router.heartbeat_timeout_s={grace:g})"
        )
    silent = now - w.last_heartbeat
    if silent > max(0.0, deadline - ran) + grace:
        step = f"; its step had run {ran:.1f}s of a {deadline:.1f}s deadline" if ran else ""
        return f"no answer for {silent:.1f}s (router.heartbeat_timeout_s={grace:g}{step})"
    return None
