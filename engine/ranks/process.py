"""One rank of a worker, 1..N-1, in its own process: join the worker's torch.distributed group, open the plan
channel, build the handler, then answer the driver's messages until it says stop or goes away.

Everything a rank needs arrives as one msgpack `bootstrap` (`RankBootstrap.encode`), so the same entry point runs
as a spawned subprocess (`run_rank`) and inside a Ray actor. The rank's replies are msgpack of
`{"ok": value}` or `{"error": traceback text}`; a handler that raises leaves the rank in its loop (the driver
decides what to do with the worker).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import select
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pdserve.engine.ranks.channel import PlanChannel, PlanChannelError, decode, encode
from pdserve.engine.ranks.dist_channel import DistPlanChannel
from pdserve.engine.ranks.shm_channel import ShmPlanChannel, ShmSpec
from pdserve.kvtransfer.store import SignedStore

__all__ = ["HandlerSpec", "RankBootstrap", "RankContext", "close_handler", "join_group", "run_rank"]

log = logging.getLogger(__name__)

OP_HELLO, OP_STEP, OP_STOP = "hello", "step", "stop"
_DRIVER_POLL_S = 1.0
"""How often an idle rank checks that its driver still lives."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankContext:
    """What a handler factory learns about its rank."""

    rank: int
    world_size: int
    device: str
    """'cpu' or 'cuda:0' (a rank process sees only its own GPU)."""
    group: Any
    """The worker's torch.distributed group (the default group of the rank's process)."""


@dataclasses.dataclass(frozen=True, slots=True)
class HandlerSpec:
    """The handler every rank runs on each step message: `target` names a factory as 'package.module:function';
    `factory(ctx: RankContext, **kwargs)` returns a callable `handler(plan) -> reply` over plain values (what
    `encode` accepts). Plain strings and values, so it travels to a rank as msgpack."""

    target: str
    kwargs: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        module, _, name = self.target.partition(":")
        if not module or not name:
            raise ValueError(f"handler target {self.target!r} must be 'package.module:function'")

    def build(self, ctx: RankContext) -> Callable[[Any], Any]:
        module, _, name = self.target.partition(":")
        factory = getattr(importlib.import_module(module), name)
        return factory(ctx, **self.kwargs)


@dataclasses.dataclass(frozen=True, slots=True)
class RankBootstrap:
    """Everything rank `rank` needs to join its worker."""

    rank: int
    world_size: int
    backend: str
    """'gloo' or 'nccl': the worker's group, for the model's collectives."""
    channel: str
    """'shm' or 'dist'."""
    store_host: str
    store_port: int
    join_timeout_s: float
    handler: HandlerSpec
    shm: dict | None = None
    """`ShmSpec.as_dict()` of the driver's channel (channel 'shm')."""
    driver_pid: int | None = None
    """The driver's process id where the rank runs on its host as its descendant (a child of the driver's fork
    server): the rank exits when the driver is gone. None where it is not (Ray actors)."""
    device: str = "cpu"
    """The rank's device: 'cpu', or the one GPU it drives ('cuda:0' where it sees only its own)."""
    secret: str = dataclasses.field(default="", repr=False)
    """The key signing every value the group's ranks put in the driver's store (`signed_store`); it travels in
    this bootstrap (a pipe to the fork server, or a Ray call), never through the store."""

    def encode(self) -> bytes:
        d = dataclasses.asdict(self)
        return encode(d)

    @classmethod
    def decode(cls, message: bytes) -> RankBootstrap:
        d = decode(message)
        d["handler"] = HandlerSpec(**d["handler"])
        return cls(**d)


def signed_store(
    raw: dist.Store, secret: str, timeout_s: float, abort: Callable[[], bool]
) -> SignedStore:
    """The rank group's view of its store (a TCPStore anyone who reaches its port can use): every value signed
    with the group's `secret`, so that a forged or copied value reads as absent; `abort` ends a wait early (the
    other side is gone). The caller keeps it as long as the group lives (C++ holds it by reference)."""
    return SignedStore(raw, secret, "pdserve-ranks/", timeout_s, keep=True, abort=abort)


def join_group(
    rank: int, world_size: int, backend: str, store: SignedStore, timeout_s: float, device: str
) -> None:
    """Joins this process to the worker's default group (collective: every rank calls it, bounded by
    `timeout_s`, or until the store's `abort` says the other side is gone: a clear DistStoreError, never a
    hang); on NCCL, `device` becomes this process's current GPU first. The caller runs a `Healer` of `store`
    from before this until every other rank has joined too (a rank may finish while its peers still read its
    values): values deleted or overwritten meanwhile are put back."""
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip


def open_channel(boot: RankBootstrap) -> PlanChannel:
    """The rank's side of the plan channel (collective for 'dist': the driver makes the same group)."""
    if boot.channel == "dist":
        return DistPlanChannel(DistPlanChannel.new_group())
    if boot.channel == "shm":
        return ShmPlanChannel.open(ShmSpec.from_dict(boot.shm), boot.rank)
    raise ValueError(f"plan channel {boot.channel!r}, expected 'shm' or 'dist'")


class DriverWatch:
    """Whether the driver process still runs, by a pidfd opened at the rank's start (readable once the process
    has ended, a zombie included; immune to the id's reuse). The rank's parent is the driver's fork server,
    which outlives the driver while ranks it forked live, so the parent's id tells nothing."""

    def __init__(self, pid: int | None):
        self.pid, self.fd, self.gone = pid, None, False
        if pid is None:
            return
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.gone = True
        except (AttributeError, OSError):  # no pidfds here: signal 0, which a zombie still answers
            self.fd = None

    def alive(self) -> bool:
        if self.pid is None or self.gone:
            return not self.gone
        if self.fd is not None:
            self.gone = bool(select.select([self.fd], [], [], 0)[0])
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.gone = True
            except PermissionError:
                pass
        return not self.gone

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def serve(boot: RankBootstrap, channel: PlanChannel, handler: Callable[[Any], Any] | None,
          setup_error: str | None, driver: DriverWatch | None = None,
          on_first: Callable[[], None] | None = None) -> None:  # fmt: skip
    """The rank loop: one reply per message until 'stop', or until the driver's process is gone; `on_first`
    runs when the first message arrives."""
    driver = driver or DriverWatch(boot.driver_pid)
    # The gloo channel cannot resume a timed-out wait: there the rank waits up to the group's timeout, and a
    # driver that dies closes its sockets, which fails the wait at once.
    poll_s = _DRIVER_POLL_S if boot.channel == "shm" else None
    while True:
        message = channel.receive(poll_s)
        if message is None:
            if not driver.alive():
                log.warning("rank %d: driver %s is gone, exiting", boot.rank, boot.driver_pid)
                return
            continue
        if on_first is not None:
            on_first()
            on_first = None
        op, plan = decode(message)
        if op == OP_STOP:
            channel.reply(encode({"ok": None}))
            return
        if setup_error is not None:
            channel.reply(encode({"error": setup_error}))
            continue
        if op == OP_HELLO:
            channel.reply(encode({"ok": os.getpid()}))
            continue
        try:
            reply = {"ok": handler(plan)}
        except Exception:  # process boundary: the driver gets the traceback
            log.exception("rank %d: handler failed", boot.rank)
            reply = {"error": traceback.format_exc()}
        channel.reply(encode(reply))


def close_handler(handler: Any) -> None:
    """Releases what a handler holds (its `close()`, when it has one); never raises."""
    close = getattr(handler, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # shutting down: what it held goes with the process
            log.warning("closing the rank's handler failed", exc_info=True)


def run_rank(bootstrap: bytes) -> None:
    """A rank process's whole life (see the module docstring)."""
    boot = RankBootstrap.decode(bootstrap)
    driver = DriverWatch(boot.driver_pid)  # at once: the id names the driver only while it lives
    if boot.backend == "gloo":
        torch.set_num_threads(1)
    raw = dist.TCPStore(
        boot.store_host, boot.store_port, boot.world_size, False,
        timeout=timedelta(seconds=boot.join_timeout_s),
    )  # fmt: skip
    store = signed_store(raw, boot.secret, boot.join_timeout_s, lambda: not driver.alive())
    # Until the driver's first message, which it sends once the whole group joined.
    healer = store.healing()
    try:
        join_group(
            boot.rank, boot.world_size, boot.backend, store, boot.join_timeout_s, boot.device
        )
        channel = open_channel(boot)
    except BaseException:
        healer.stop()
        raise
    handler, setup_error = None, None
    try:
        ctx = RankContext(boot.rank, boot.world_size, boot.device, dist.group.WORLD)
        handler = boot.handler.build(ctx)
    except Exception:  # reported to the driver on its first message
        setup_error = traceback.format_exc()
    try:
        serve(boot, channel, handler, setup_error, driver, healer.stop)
    except PlanChannelError:
        log.warning("rank %d: plan channel failed", boot.rank, exc_info=True)
    finally:
        healer.stop()
        close_handler(handler)
        driver.close()
        channel.close()
        dist.destroy_process_group()
