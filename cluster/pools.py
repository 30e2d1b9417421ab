"""The worker pools' members: `WorkerHandle` (the router's view of one worker) and `Launcher`, which places a
worker (its own placement group), starts its actor, waits for its model to load, and stops it again."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.cluster import placement
from pdserve.cluster.actors import DecodeShell, PrefillShell
from pdserve.cluster.config import ServeConfig
from pdserve.cluster.fixed_rate_decode import FixedRateDecodeShell
from pdserve.cluster.prefix_routing import PrefixIndex
from pdserve.engine import messages
from pdserve.engine.messages import DecodeStats, PrefillStats
from pdserve.kvtransfer import KVTransferConfig
from pdserve.model.errors import CapacityError

logger = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
_SHELLS = {PREFILL: ray.remote(PrefillShell), DECODE: ray.remote(DecodeShell)}
_FIXED_RATE_DECODE = ray.remote(FixedRateDecodeShell)
_STOP_TIMEOUT_S = 15.0


class WorkerState:
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    DEAD = "dead"
    """Stopped or lost: out of the pools."""


@dataclasses.dataclass(eq=False)
class WorkerHandle:
    """One worker as the router sees it. Touched only on the router's event loop."""

    worker_id: str
    role: str
    actor: Any
    placement_group: Any
    num_gpus: int
    state: str = WorkerState.STARTING
    node_ip: str = ""
    device: str = ""
    num_pages: int = 0
    page_size: int = 0
    stats: PrefillStats | DecodeStats | None = None
    """The latest stats the worker reported."""
    requests: set[str] = dataclasses.field(default_factory=set)
    """Requests on this worker: a decode worker's from admission to finish, a prefill worker's until their
    first token arrives from the decode side."""
    queued_tokens: int = 0
    """Prompt tokens placed here to prefill whose first token has not come yet (the router's load measure of
    a prefill worker; of a decode worker, those of the requests it prefills itself)."""
    prefix: PrefixIndex | None = None
    """What its prefix cache holds, by its cache events (None: its cache is off)."""
    reserved_pages: int = 0
    """Decode: pages reserved here since `stats` was taken."""
    in_flight_pages: int = 0
    """Decode: pages of the requests sent here whose reservation has not been answered yet."""
    poller: asyncio.Task | None = None
    last_heartbeat: float = 0.0
    """time.monotonic() of the worker's latest answer to a stats call or a long-poll (or of its start)."""
    num_migrated: int = 0
    """Requests moved off this worker after it was lost."""

    @property
    def free_pages(self) -> int:
        """Decode: free pages, estimated from the latest stats, reservations since and those under way."""
        used = self.stats.pages_used if self.stats is not None else 0
        return self.num_pages - used - self.reserved_pages - self.in_flight_pages

    @property
    def num_running(self) -> int:
        return len(self.requests)


def _rounded(resources: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in resources.items() if k in ("CPU", "GPU")}


class Launcher:
    """Starts and stops worker actors. Each worker gets its own placement group and a unique id."""

    def __init__(
        self,
        config: ServeConfig,
        kv_config: KVTransferConfig,
        num_gpus: int,
        store_secret: str = "",
    ):
        """store_secret: the key that signs the KV store's values (`kvtransfer.store`), handed to each worker
        through Ray."""
        self.config, self.kv_config, self.num_gpus = config, kv_config, num_gpus
        self.store_secret = store_secret
        self._ids = {role: itertools.count() for role in ROLES}
        self.group_prefix = f"pdserve-{secrets.token_hex(4)}"
        """Each worker's placement group is named `{group_prefix}-{worker_id}`: placement group names are global
        to a Ray cluster, and two servers on one cluster number their workers alike."""

    async def launch(self, role: str) -> WorkerHandle:
        """A worker whose model is loaded (state STARTING: not yet warmed up). Raises CapacityError when the
        cluster cannot place it within placement_timeout_s, or the error its actor failed to start with."""
        cluster = self.config.cluster
        worker_id = f"{role}-{next(self._ids[role])}"
        worker_config = self.config.prefill if role == PREFILL else self.config.decode
        num_gpus = self.num_gpus
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        totals = [n["Resources"] for n in nodes]
        ranks = worker_config.layout.ranks
        if ranks > 1:  # one bundle per rank, each rank one GPU (or none on CPU)
            num_gpus = int(self.num_gpus > 0)
            bundles = placement.rank_bundles(ranks, num_gpus, cluster.cpus_per_worker)
            labels = [n.get("Labels", {}) for n in nodes]
            reason = placement.ranks_unplaceable_reason(bundles, totals, labels, cluster.rank_span)
            strategy = placement.rank_placement(cluster.rank_span)
        else:
            bundles = placement.worker_bundles(self.num_gpus, cluster.cpus_per_worker)
            reason = placement.unplaceable_reason(bundles, totals)
            strategy = {"strategy": placement.STRATEGY}
        if reason is not None:
            raise CapacityError(f"cannot place {worker_id}: {reason}")
        group = ray.util.placement_group(
            bundles, name=f"{self.group_prefix}-{worker_id}", **strategy
        )
        # the worker's GPUs in all (each of its ranks holds num_gpus)
        handle = WorkerHandle(worker_id, role, None, group, num_gpus * ranks)
        if not placement.fits_now(bundles, ray.available_resources()):
            logger.warning(
                "%s waits up to %gs for %s (available now: %s)", worker_id,
                cluster.placement_timeout_s, bundles[0], _rounded(ray.available_resources()),
            )  # fmt: skip
        try:
            try:
                await asyncio.wait_for(group.ready(), cluster.placement_timeout_s)
            except TimeoutError:
                raise CapacityError(
                    f"cannot place {worker_id}: {len(bundles)} x {bundles[0]} not free where its placement "
                    "allows (one node, or one NVLink domain with cluster.rank_span=nvlink_domain) within "
                    f"{cluster.placement_timeout_s:g}s (available: "
                    f"{_rounded(ray.available_resources())})"
                ) from None
            fake = role == DECODE and cluster.benchmark_fake_decode_ms > 0
            options = dict(
                num_cpus=cluster.cpus_per_worker,
                num_gpus=num_gpus,
                max_concurrency=cluster.actor_max_concurrency,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
            )
            if fake:  # benchmark only: no model
                handle.actor = _FIXED_RATE_DECODE.options(**options).remote(
                    worker_id, self.config.model, cluster.benchmark_fake_decode_ms,
                    cluster.benchmark_fake_decode_tokens,
                )  # fmt: skip
            else:
                handle.actor = _SHELLS[role].options(**options).remote(
                    worker_id, self.config.model, worker_config, self.kv_config, num_gpus,
                    placement.cpu_threads(cluster.cpus_per_worker), cluster.cpus_per_worker,
                    self.store_secret,
                )  # fmt: skip
            try:
                ready = await asyncio.wait_for(handle.actor.ready.remote(), cluster.load_timeout_s)
            except TimeoutError:
                raise CapacityError(
                    f"{worker_id} did not load the model within {cluster.load_timeout_s:g}s"
                ) from None
            info = messages.unwrap(dict, ready)
        except BaseException:
            await self.stop(handle)
            raise
        handle.node_ip, handle.device = info["node_ip"], info["device"]
        handle.last_heartbeat = time.monotonic()
        handle.num_pages, handle.page_size = info["num_pages"], info["page_size"]
        handle.prefix = PrefixIndex.from_info(info.get("prefix_cache"))
        logger.info(
            "%s up on %s (%s): %d KV pages = %d tokens", worker_id, handle.node_ip,
            handle.device, handle.num_pages, handle.num_pages * handle.page_size,
        )  # fmt: skip
        return handle

    async def stop(self, handle: WorkerHandle, close: bool = True) -> None:
        """Closes the worker (bounded; not when `close` is false: a lost one), kills its actor and frees its
        placement group."""
        if handle.actor is not None:
            if close:
                with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                    await asyncio.wait_for(handle.actor.close.remote(), _STOP_TIMEOUT_S)
            ray.kill(handle.actor)
        ray.util.remove_placement_group(handle.placement_group)
