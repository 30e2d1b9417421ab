"""Growing and shrinking the pools: start workers (placed, loaded, warmed up by one short request through a real
(P, D) pair, then serving), drain workers (no new requests; stopped once their requests are done or after
drain_timeout_s, when those left move to other workers). Lost workers are replaced by the supervisor
(`supervisor`), through `add`."""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.errors import NotFoundError, PreconditionError
from pdserve.cluster.pools import DECODE, PREFILL, ROLES, Launcher, WorkerHandle, WorkerState
from pdserve.cluster.router import Router
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.errors import ConfigError

logger = logging.getLogger(__name__)

_WARM_UP_TOKENS = 2
_DRAIN_POLL_S = 0.05


class Scaler:
    def __init__(self, config: ServeConfig, router: Router, launcher: Launcher, bos_id: int | None):
        self.config, self.router, self.launcher = config, router, launcher
        self._warm_up_prompt = [bos_id or 0, *range(3, 3 + 15)]
        self._lock = asyncio.Lock()  # one scaling operation at a time

    async def start(self, num_prefill: int, num_decode: int) -> None:
        """Starts both pools; raises (after stopping what did start) if any worker fails."""
        async with self._lock:
            await self._add({PREFILL: num_prefill, DECODE: num_decode})

    async def add(self, role: str, count: int) -> list[WorkerHandle]:
        """Starts `count` more workers of `role` (warm and serving on return); raises if any fails."""
        async with self._lock:
            return await self._add({role: count})

    async def _add(self, counts: dict[str, int]) -> list[WorkerHandle]:
        launches = [
            self.launcher.launch(role) for role in ROLES for _ in range(counts.get(role, 0))
        ]
        results = await asyncio.gather(*launches, return_exceptions=True)
        new = [w for w in results if isinstance(w, WorkerHandle)]
        errors = [e for e in results if isinstance(e, BaseException)]
        try:
            if errors:
                raise errors[0]
            for w in new:
                self.router.add_worker(w)
            await self._warm_up(new)
        except BaseException:
            for w in new:
                self.router.remove_worker(w)
                w.state = WorkerState.DEAD
            await asyncio.gather(*(self.launcher.stop(w) for w in new), return_exceptions=True)
            raise
        for w in new:
            w.state = WorkerState.SERVING
        self.router.on_workers_changed()
        return new

    async def _warm_up(self, new: list[WorkerHandle]) -> None:
        """One short request through each new worker, paired with a new or else a serving peer (no prefill
        worker at all: the decode worker prefills itself)."""
        new_prefills = [w for w in new if w.role == PREFILL]
        new_decodes = [w for w in new if w.role == DECODE]
        prefills = new_prefills or self.router.pool(PREFILL, WorkerState.SERVING)
        decodes = new_decodes or self.router.pool(DECODE, WorkerState.SERVING)
        if not decodes:
            raise PreconditionError("cannot warm up prefill workers: no decode worker is serving")
        pairs = [
            (prefills[i % len(prefills)] if prefills else None, decodes[i % len(decodes)])
            for i in range(max(len(new_prefills), len(new_decodes)))
        ]
        await asyncio.gather(*(self._warm_up_pair(p, d) for p, d in pairs))

    async def _warm_up_pair(self, prefill: WorkerHandle | None, decode: WorkerHandle) -> None:
        start = time.monotonic()
        params = SamplingParams(max_tokens=_WARM_UP_TOKENS, ignore_eos=True, seed=0)
        deadline = asyncio.get_running_loop().time() + self.config.cluster.load_timeout_s
        name = f"warm-up-{prefill.worker_id if prefill else 'local'}-{decode.worker_id}"
        r = self.router.open(name, self._warm_up_prompt, params, deadline)
        try:
            while await self.router.next_tokens(r, force=(prefill, decode)) is not None:
                pass
        finally:
            self.router.close(r)
        logger.info(
            "warmed up %s in %.2fs", name.removeprefix("warm-up-"), time.monotonic() - start
        )

    async def scale(self, role: str, count: int) -> tuple[list[str], list[str]]:
        """Grows or shrinks `role`'s pool to `count` workers; returns (added, removed) worker ids."""
        if role not in ROLES:
            raise ConfigError(f"role {role!r}: expected prefill or decode")
        if role == DECODE and count < 1:
            raise ConfigError("count: the decode pool needs at least 1 worker")
        async with self._lock:
            current = self.router.pool(role, WorkerState.STARTING, WorkerState.SERVING)
            if count > len(current):
                added = await self._add({role: count - len(current)})
                return [w.worker_id for w in added], []
            # Drain the least loaded, newest first.
            victims = sorted(current, key=lambda w: (w.num_running, -_index(w)))[
                : len(current) - count
            ]
            await asyncio.gather(*(self._drain(w) for w in victims))
            return [], [w.worker_id for w in victims]

    async def drain(self, worker_id: str) -> int:
        """Drains and stops one worker; returns how many requests it had when the drain began."""
        async with self._lock:
            w = self.router.workers.get(worker_id)
            if w is None or w.state == WorkerState.DEAD:
                raise NotFoundError(f"no worker {worker_id!r} (see `pdserve status`)")
            if w.state == WorkerState.DRAINING:
                raise PreconditionError(f"{worker_id} is already draining")
            serving = self.router.pool(w.role, WorkerState.SERVING)
            if w.role == DECODE and serving == [w]:
                raise PreconditionError(f"{worker_id} is the last serving decode worker")
            return await self._drain(w)

    async def _drain(self, w: WorkerHandle) -> int:
        w.state = WorkerState.DRAINING
        self.router.on_workers_changed()
        num_requests = len(w.requests)
        logger.info("draining %s (%d requests)", w.worker_id, num_requests)
        give_up = time.monotonic() + self.config.router.drain_timeout_s
        while w.requests and w.state != WorkerState.DEAD and time.monotonic() < give_up:
            await asyncio.sleep(_DRAIN_POLL_S)
        if w.requests:
            logger.warning(
                "%s: %d requests left at the drain timeout", w.worker_id, len(w.requests)
            )
            self.router.fail_requests(w, f"{w.worker_id} was drained before the request finished")
        if w.state != WorkerState.DEAD:
            w.state = WorkerState.DEAD
            self.router.remove_worker(w)
            await self.launcher.stop(w)
        logger.info("stopped %s", w.worker_id)
        return num_requests

    async def stop_all(self) -> None:
        workers = list(self.router.workers.values())
        for w in workers:
            w.state = WorkerState.DEAD
            self.router.remove_worker(w)
        await asyncio.gather(*(self.launcher.stop(w) for w in workers), return_exceptions=True)


def _index(w: WorkerHandle) -> int:
    return int(w.worker_id.rsplit("-", 1)[1])
