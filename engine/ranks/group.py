"""A worker's N ranks seen from its driver: rank 0 runs in the worker's own process, ranks 1..N-1 in processes
started by a `RankLauncher` (local subprocesses here; Ray actors on a placement group's bundles in
`pdserve.cluster.rank_actors`). All N join one torch.distributed group (gloo on CPU, NCCL on GPUs) through a
TCPStore the driver hosts (signed with a secret of the group's own, carried in each rank's bootstrap:
`process.signed_store`), and every step the driver broadcasts its plan over the plan channel, runs its own
share of the step, and gathers the others' replies.

`RankGroup.step(plan)` returns the N replies in rank order or raises: `RankStepError` when a handler raised
(the traceback inside), `RankLostError` when a rank died or stayed silent past `step_timeout_s`. Either way the
group has failed: the caller fails the worker's requests and calls `close()`, which stops or kills every rank
process within its own timeout.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import multiprocessing as mp
import os
import time
from typing import Any

import torch.distributed as dist

from pdserve.engine.ranks.channel import (
    PlanChannel,
    PlanChannelError,
    PlanTooLargeError,
    RankLostError,
    decode,
    encode,
)
from pdserve.engine.ranks.dist_channel import DistPlanChannel
from pdserve.engine.ranks.process import (
    OP_HELLO,
    OP_STEP,
    OP_STOP,
    HandlerSpec,
    RankBootstrap,
    RankContext,
    close_handler,
    join_group,
    run_rank,
    signed_store,
)
from pdserve.engine.ranks.shm_channel import ShmPlanChannel
from pdserve.kvtransfer.store import SignedStore, host_store, new_secret
from pdserve.model.errors import PdserveError

__all__ = ["LocalRankLauncher", "RankGroup", "RankGroupConfig", "RankLauncher", "RankStepError"]

log = logging.getLogger(__name__)

CHANNELS = ("shm", "dist")
BACKENDS = ("gloo", "nccl")


class RankStepError(PdserveError):
    """A rank's handler raised while running a step; the message holds its traceback."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankGroupConfig:
    world_size: int
    """Ranks of the worker, the driver included."""
    backend: str = "gloo"
    """The worker's torch.distributed backend: 'gloo' (CPU) or 'nccl' (one GPU per rank)."""
    channel: str = "shm"
    """Plan channel: 'shm' (ranks on the driver's node) or 'dist' (a gloo group; ranks on any node)."""
    store_host: str = "127.0.0.1"
    """Address the driver's TCPStore listens on and ranks connect to."""
    join_timeout_s: float = 120.0
    """Starting the ranks, joining the group and building every handler."""
    step_timeout_s: float = 60.0
    """Longest a step may take on any rank before the driver declares it lost."""
    stop_timeout_s: float = 10.0
    """Waiting for ranks to exit on close before killing them."""
    max_message_bytes: int = 4 << 20
    """Largest plan or reply (bytes of msgpack)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}, expected one of {BACKENDS}")
        if self.channel not in CHANNELS:
            raise ValueError(f"channel={self.channel!r}, expected one of {CHANNELS}")
        for name in ("join_timeout_s", "step_timeout_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")


class RankLauncher(abc.ABC):
    """Starts and watches the processes of ranks 1..N-1."""

    watches_driver_pid = True
    """Ranks run on the driver's host as its descendants and exit when it is gone (`RankBootstrap.driver_pid`)."""

    def device(self, rank: int, backend: str) -> str:
        """The device rank `rank` drives: the CPU on gloo; on NCCL, GPU `rank` of the host (ranks as local
        processes see every GPU). A launcher whose ranks see only their own GPU answers 'cuda:0'."""
        return f"cuda:{rank}" if backend == "nccl" else "cpu"

    @abc.abstractmethod
    def launch(self, bootstraps: list[bytes]) -> None:
        """Start one rank per bootstrap (ranks 1..N-1 in order), each running `run_rank(bootstrap)`; returns at
        once."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise `RankLostError` naming every rank whose process has ended."""

    @abc.abstractmethod
    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the ranks to exit, then kill those left; idempotent."""


RANK_PRELOAD = ("pdserve.engine.ranks.process",)
"""What the fork server imports once for every rank it forks: torch and torch.distributed, nothing that touches
CUDA (a fork after CUDA's initialization could not use it)."""


def rank_process_context() -> mp.context.BaseContext:
    """The multiprocessing context local rank processes start from: a fork server, started once per driver
    process, that has imported `RANK_PRELOAD`. A spawned rank imports torch again, the most of its start-up's
    CPU; a rank forked from the server starts with it imported. The server starts as a fresh interpreter (not a
    fork of the driver, whose threads and CUDA state a fork would copy) and ends with the driver."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    return ctx


class LocalRankLauncher(RankLauncher):
    """Ranks as subprocesses of the driver's process (tests, offline, a single host without Ray), forked from
    its fork server (`rank_process_context`)."""

    def __init__(self) -> None:
        self.procs: list[mp.Process] = []

    def launch(self, bootstraps: list[bytes]) -> None:
        ctx = rank_process_context()
        for rank, boot in enumerate(bootstraps, start=1):
            proc = ctx.Process(
                target=run_rank, args=(boot,), name=f"pdserve-rank{rank}", daemon=True
            )
            proc.start()
            self.procs.append(proc)

    def check(self) -> None:
        dead = [
            (rank, p.exitcode) for rank, p in enumerate(self.procs, start=1) if not p.is_alive()
        ]
        if dead:
            raise RankLostError([r for r, _ in dead], f"process exited (exit codes {dead})")

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


def _abort_group() -> None:
    """Aborts this process's default (NCCL) group, ending any collective in flight; never raises."""
    from torch.distributed import distributed_c10d

    try:
        distributed_c10d._abort_process_group()
    except (
        Exception
    ):  # already torn down, or a torch without it: destroy_process_group follows anyway
        log.warning("aborting the rank group's communicator failed", exc_info=True)


class RankGroup:
    """The driver of one worker's ranks (see the module docstring). `start()` blocks until every rank joined and
    built its handler (bounded by `join_timeout_s`); use it as a context manager to close it in all cases. The
    group is the default torch.distributed group of the driver's process and of each rank's, so a process holds
    at most one rank group (other groups, such as KV transfer's, are made apart from the default one)."""

    def __init__(
        self, config: RankGroupConfig, handler: HandlerSpec, launcher: RankLauncher | None = None
    ):
        self.config, self.handler_spec = config, handler
        self.launcher = launcher or LocalRankLauncher()
        self.channel: PlanChannel | None = None
        self.handler = None
        self._store: dist.TCPStore | None = None
        self._signed: SignedStore | None = None
        """The signed view the group was built on: it must outlive the group."""
        self._failed = False
        self.rank_pids: list[int] = []
        """Process ids of ranks 1..N-1, once started."""

    def __enter__(self) -> RankGroup:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def start(self) -> None:
        cfg = self.config
        # on store_host alone (a plain TCPStore server listens on every interface)
        self._store = host_store(cfg.store_host, 0, cfg.join_timeout_s, cfg.world_size)
        secret = new_secret()  # this group's own: it signs the rendezvous (`signed_store`)
        self._signed = signed_store(self._store, secret, cfg.join_timeout_s, self._ranks_gone)
        shm = None
        if cfg.channel == "shm":
            self.channel = ShmPlanChannel.create(
                cfg.world_size, cfg.max_message_bytes, cfg.max_message_bytes
            )
            shm = self.channel.spec.as_dict()
        boots = [
            RankBootstrap(
                rank, cfg.world_size, cfg.backend, cfg.channel, cfg.store_host, self._store.port,
                cfg.join_timeout_s, self.handler_spec, shm,
                os.getpid() if self.launcher.watches_driver_pid else None,
                self.launcher.device(rank, cfg.backend), secret,
            ).encode()
            for rank in range(1, cfg.world_size)
        ]  # fmt: skip
        self.launcher.launch(boots)
        device = self.launcher.device(0, cfg.backend)
        # Until every rank answered: the last of them may still be reading the driver's values.
        with self._signed.healing():
            join_group(0, cfg.world_size, cfg.backend, self._signed, cfg.join_timeout_s, device)
            if cfg.channel == "dist":
                self.channel = DistPlanChannel(
                    DistPlanChannel.new_group(), cfg.max_message_bytes, cfg.step_timeout_s
                )
            ctx = RankContext(0, cfg.world_size, device, dist.group.WORLD)
            self.handler = self.handler_spec.build(ctx)
            pids = self._round(OP_HELLO, None, cfg.join_timeout_s)
        self.rank_pids = pids[1:]
        if isinstance(self.channel, ShmPlanChannel):
            self.channel.unlink()  # every rank has it mapped now
        log.info("rank group of %d up (rank pids %s)", cfg.world_size, pids)

    def _ranks_gone(self) -> bool:
        """Whether a rank's process has ended (the join stops waiting for it)."""
        try:
            self.launcher.check()
        except RankLostError:
            return True
        return False

    def step(self, plan: Any) -> list[Any]:
        """Runs one step on every rank: `plan` (plain values) goes to each rank's handler; returns the replies,
        rank 0's first."""
        if self.handler is None or self._failed:
            raise PlanChannelError(
                "the rank group is not running (never started, failed or closed)"
            )
        return self._round(OP_STEP, plan, self.config.step_timeout_s)

    def _round(self, op: str, plan: Any, timeout_s: float) -> list[Any]:
        message = encode(
            [op, plan]
        )  # a plan that is not plain values fails here, and the group goes on
        try:
            self.channel.broadcast(message)
        except PlanTooLargeError:
            raise  # refused before anything was sent: the group goes on
        except BaseException:
            self._failed = True
            raise
        try:
            mine = self.handler(plan) if op == OP_STEP else os.getpid()
            raw = self.channel.gather(timeout_s, check=self.launcher.check)
        except BaseException:
            self._failed = True
            raise
        replies, errors = [mine], []
        for rank, message in enumerate(raw, start=1):
            reply = decode(message)
            if "error" in reply:
                errors.append(f"rank {rank}:\n{reply['error']}")
            replies.append(reply.get("ok"))
        if errors:
            self._failed = True
            raise RankStepError("\n".join(errors))
        return replies

    def close(self) -> None:
        """Stops every rank (a 'stop' message when the group still works, a kill of those not gone within
        `stop_timeout_s`; after a failure, a kill at once), leaves the group and frees the channel; idempotent."""
        cfg = self.config
        stopped = False
        if self.channel is not None and not self._failed and self.handler is not None:
            try:
                self.channel.broadcast(encode([OP_STOP, None]))
                self.channel.gather(cfg.stop_timeout_s, check=self.launcher.check)
                stopped = True
            except PlanChannelError as e:
                log.warning("rank group: stopping the ranks: %s", e)
        self._failed = True
        # ranks that did not acknowledge 'stop' may be stuck in a step or a collective: kill them now
        self.launcher.stop(cfg.stop_timeout_s if stopped else 0.0)
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if not stopped and cfg.backend == "nccl" and dist.is_initialized():
            # a rank died or hung: a collective of ours may wait for it forever, and a clean teardown (or a
            # device sync) with it; aborting the communicator ends them
            _abort_group()
        close_handler(
            self.handler
        )  # after a clean stop: its CUDA graphs go before the communicator
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = self._signed = None
        self.handler = None
