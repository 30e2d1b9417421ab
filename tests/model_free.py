"""Model-free stand-ins for the engine's tests: a fake runner that lets the real `PrefillWorker`, `DecodeWorker`
and `Scheduler` run without weights, a KV transport whose faults are injected per transfer, and a pump that steps
workers until a condition holds (never without a deadline).

The fake runner keeps a real page-major cache (int64 [num_pages, 1, page_size, 1]): each token it runs writes
token + 1 into its slot, and the token it samples after position p is `next_token` of the values its pages hold at
positions 0..p. So a request whose KV went to the wrong pages, was not carried by the transfer, or was overwritten
by another request's samples other tokens than `reference(prompt, n)`: tests compare streams with it.

The transport is the in-process loopback (`pdserve.kvtransfer.loopback`) with faults per (peer, transfer id):
drop (nothing arrives: the sender times out, the receiver's deadline fails it), hold (the send waits until
released or the peer dies: a transfer in flight), duplicate (delivered twice at once), ack (delivered, the
acknowledgement held), and every delivered transfer can be delivered again later (`FaultyHub.redeliver`).
`FaultyHub.kill` is a worker dying: a decode worker's receiver is gone and sends to it, those under way
included, fail at once; a prefill worker sends nothing more. `FaultySender.send` passes what follows the page ids
on to the receiver's `deliver` (num_tokens, first_token): a transfer that carries more hands it on there.

For the router, `WorkerActor` puts a worker where its Ray actor would be: the router's calls run on threads of
this process, the worker's loop on another, and `die` is the actor's process dying."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import ray.exceptions
import torch

from pdserve.decode import DecodeConfig, DecodeWorker
from pdserve.engine import messages
from pdserve.engine.host_store import HostKVStore
from pdserve.engine.messages import DecodeRequest, PrefillRequest
from pdserve.engine.step import RankResult, StepPlan
from pdserve.kvtransfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from pdserve.kvtransfer.pages import gather_pages
from pdserve.model.errors import TransferError
from pdserve.prefill import PrefillConfig, PrefillWorker

VOCAB = 64
EOS = 0
"""Never sampled by the fake runner: requests end on max_tokens."""
PAGE = 4
MAX_LEN = 256

# The fake model step.


def next_token(values: list[int]) -> int:
    """The token the fake runner samples after a sequence whose KV slots hold `values` (token + 1 each): a hash
    of the whole sequence, never EOS."""
    h = 17
    for v in values:
        h = (h * 31 + v) % 1_000_003
    return 1 + h % (VOCAB - 1)


def reference(prompt: list[int], n: int) -> list[int]:
    """The n tokens the fake runner generates after `prompt` when every page is where it should be."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token([t + 1 for t in seq]))
    return seq[len(prompt) :]


@dataclasses.dataclass(frozen=True)
class _Args:
    vocab_size: int = VOCAB
    max_position_embeddings: int = MAX_LEN
    eos_token_ids: tuple[int, ...] = (EOS,)


class _Model:
    args = _Args()


@dataclasses.dataclass(frozen=True)
class _Layout:
    page_bytes: int


class _Cache:
    def __init__(self, num_pages: int, page_size: int):
        self.data = torch.zeros(num_pages, 1, page_size, 1, dtype=torch.int64)
        self.layout = _Layout(page_size * 8)
        self.device = torch.device("cpu")


class FakeRunner:
    """Stands in for `ModelRunner` (one rank): runs a plan's prefill rows, then its decode rows, over its cache.
    `fail_prefill` / `fail_decode`: the error of every later pass of that kind (None: it succeeds);
    `on_execute`: called with each plan before its passes run, without the worker's lock (a test aborts a
    request mid-step there). host_slots: pages of a host tier (`HostKVStore` over its cache; the worker issues
    the copies, synchronous on the CPU)."""

    def __init__(self, num_pages: int, page_size: int = PAGE, host_slots: int = 0):
        self.model, self.page_size, self.num_pages = _Model(), page_size, num_pages
        self.cache = _Cache(num_pages, page_size)
        self.host_store = HostKVStore(self.cache, host_slots) if host_slots else None
        self.device, self.graphs = torch.device("cpu"), None
        self.fail_prefill: str | None = None
        self.fail_decode: str | None = None
        self.on_execute: Callable[[StepPlan], None] | None = None
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> RankResult:
        self.plans.append(plan)
        if self.on_execute is not None:
            self.on_execute(plan)
        step, result = plan.ranks[0], RankResult(plan.step_id)
        if step.prefill:
            if self.fail_prefill is not None:
                result = dataclasses.replace(result, prefill_error=self.fail_prefill)
            else:
                for row in step.prefill:
                    for i, t in enumerate(row.token_ids):
                        self._write(row.page_ids, row.start + i, t)
                    end = row.start + len(row.token_ids) - 1
                    sampled = None if row.sample is None else self._sample(row.page_ids, end)
                    result.prefill_tokens.append(sampled)
        if step.decode:
            if self.fail_decode is not None:
                result = dataclasses.replace(result, decode_error=self.fail_decode)
            else:
                for row in step.decode:
                    self._write(row.page_ids, row.position, row.token_id)
                    result.decode_tokens.append(self._sample(row.page_ids, row.position))
        return result

    def _slot(self, page_ids: list[int], position: int) -> tuple[int, int]:
        page = page_ids[position // self.page_size]
        assert 0 <= page < self.num_pages, f"page {page} outside the cache"
        return page, position % self.page_size

    def _write(self, page_ids: list[int], position: int, token: int) -> None:
        page, slot = self._slot(page_ids, position)
        self.cache.data[page, 0, slot, 0] = token + 1

    def _sample(self, page_ids: list[int], last: int) -> int:
        pages = page_ids[: last // self.page_size + 1]
        values = self.cache.data[pages].flatten().tolist()[: last + 1]
        return next_token(values)


# The transport.


@dataclasses.dataclass
class Fault:
    """What happens to one transfer. drop: never delivered (the send times out); hold: the send waits until
    the event is set (or its peer dies, or it times out); duplicate: delivered twice."""

    drop: bool = False
    hold: threading.Event | None = None
    duplicate: bool = False
    ack: threading.Event | None = None
    """Delivered, but the acknowledgement comes (the send returns) only once this is set."""


class FaultyHub(LoopbackHub):
    """Connects `FaultySender`s to `LoopbackReceiver`s by worker id, with faults per (peer, transfer id)."""

    def __init__(self) -> None:
        super().__init__()
        self.faults: dict[tuple[str, int], Fault] = {}
        self.dead: set[str] = set()
        self.delivered: dict[tuple[str, int], tuple] = {}
        """The arguments of each transfer's delivery (for `redeliver`)."""
        self.changed = threading.Condition()

    def receiver(self, worker_id: str) -> Callable[[torch.Tensor], LoopbackReceiver]:
        """A decode worker's `make_receiver`."""
        return lambda cache: LoopbackReceiver(self, worker_id, cache)

    def fault(self, peer: str, transfer_id: int, **kind) -> Fault:
        self.faults[(peer, transfer_id)] = fault = Fault(**kind)
        return fault

    def hold(self, peer: str, transfer_id: int) -> threading.Event:
        """Holds the transfer's send until the returned event is set (`release`)."""
        return self.fault(peer, transfer_id, hold=threading.Event()).hold

    def release(self, event: threading.Event) -> None:
        with self.changed:
            event.set()
            self.changed.notify_all()

    def kill(self, peer: str) -> None:
        """Worker `peer` dies: nothing reaches it or leaves it any more, sends under way to it fail at once."""
        with self.changed:
            self.dead.add(peer)
            self.receivers.pop(peer, None)
            self.changed.notify_all()

    def redeliver(self, peer: str, transfer_id: int) -> None:
        """Delivers an earlier transfer to `peer` again (a duplicate that comes late)."""
        self.receivers[peer].deliver(*self.delivered[(peer, transfer_id)])


class FaultySender(LoopbackSender):
    """Prefill worker `worker_id`'s sender: the loopback's with the hub's faults; `timeout_s` bounds every
    send, as `KVSender` requires. Once the hub has its worker dead (`FaultyHub.kill`), nothing more leaves."""

    def __init__(self, hub: FaultyHub, worker_id: str, timeout_s: float = 1.0):
        super().__init__(hub)
        self.hub: FaultyHub = hub
        self.worker_id, self.timeout_s = worker_id, timeout_s
        self.forgotten: set[str] = set()

    def forget(self, peer: str) -> None:
        with self.hub.changed:
            self.forgotten.add(peer)
            self.hub.changed.notify_all()

    def send(
        self, peer: str, transfer_id: int, cache: torch.Tensor, page_ids: list[int],
        num_tokens: int, first_token: int, dest_cuts: Sequence[int] = (), metadata: bytes = b"",
    ) -> None:  # fmt: skip
        fault = self.hub.faults.pop((peer, transfer_id), Fault())
        give_up = time.monotonic() + self.timeout_s
        with self.hub.changed:
            while True:
                if self.worker_id in self.hub.dead:
                    raise TransferError(f"KV transfer {transfer_id}: {self.worker_id} is dead")
                if peer in self.hub.dead or peer in self.forgotten:
                    raise TransferError(
                        f"KV transfer {transfer_id}: decode worker {peer!r} is gone"
                    )
                if not fault.drop and (fault.hold is None or fault.hold.is_set()):
                    break
                left = give_up - time.monotonic()
                if left <= 0:
                    raise TransferError(
                        f"KV transfer {transfer_id} to {peer!r}: no acknowledgement within "
                        f"{self.timeout_s:g}s"
                    )
                self.hub.changed.wait(left)
        receiver = self.hub.receivers.get(peer)
        if receiver is None:
            raise TransferError(f"KV transfer {transfer_id}: no decode worker {peer!r}")
        pages = gather_pages(cache, torch.tensor(page_ids, dtype=torch.int64))
        args = (transfer_id, pages, num_tokens, first_token, metadata)
        self.hub.delivered[(peer, transfer_id)] = args
        for _ in range(1 + fault.duplicate):
            receiver.deliver(*args)
        if fault.ack is not None:
            with self.hub.changed:
                while not fault.ack.is_set() and self.hub.changed.wait(give_up - time.monotonic()):
                    pass


# Workers and stepping.


def prefill_worker(
    hub: FaultyHub, worker_id: str = "p0", num_pages: int = 16, send_timeout_s: float = 1.0,
    **config,
) -> PrefillWorker:  # fmt: skip
    """A real prefill worker over a `FakeRunner`, sending through `hub`."""
    config = PrefillConfig(page_size=PAGE, num_pages=num_pages, **config)
    return PrefillWorker(
        worker_id, None, config, FaultySender(hub, worker_id, send_timeout_s),
        runner=FakeRunner(num_pages),
    )  # fmt: skip


def decode_worker(
    hub: FaultyHub | None, worker_id: str = "d0", num_pages: int = 16, kv_wait_timeout_s: float = 1.0,
    host_slots: int = 0, **config,
) -> DecodeWorker:  # fmt: skip
    """A real decode worker over a `FakeRunner` (with a host tier of `host_slots` pages), receiving through
    `hub` (None: aggregated only)."""
    config = DecodeConfig(
        page_size=PAGE, num_pages=num_pages, kv_wait_timeout_s=kv_wait_timeout_s, **config
    )
    return DecodeWorker(
        worker_id, None, config, None if hub is None else hub.receiver(worker_id),
        runner=FakeRunner(num_pages, host_slots=host_slots),
    )  # fmt: skip


def pump(
    workers: list, until: Callable[[], bool], timeout_s: float = 10.0, what: str = "the condition"
) -> None:
    """Steps `workers` (each `step()`) until `until()` holds; fails after `timeout_s`. Waits a little between
    rounds when no worker had work (sends and deadlines run on their own clocks)."""
    give_up = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < give_up, f"{what} did not happen within {timeout_s:g}s"
        if not any([w.step() for w in workers]):
            time.sleep(0.001)


class Streams:
    """What a decode worker streamed, per request: its tokens, how it finished and why (`collect` polls)."""

    def __init__(self, decode: DecodeWorker):
        self.decode = decode
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.errors: dict[str, str | None] = {}
        self.preempted: set[str] = set()

    def collect(self) -> Streams:
        for out in self.decode.poll_outputs():
            self.tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.preempted:
                self.preempted.add(out.request_id)
            if out.finish_reason is not None:
                assert out.request_id not in self.finish, f"{out.request_id} finished twice"
                self.finish[out.request_id] = out.finish_reason
                self.errors[out.request_id] = out.error
        return self

    def ended(self, *request_ids: str) -> Callable[[], bool]:
        """A `pump` condition: every one of `request_ids` finished (or was preempted)."""
        return lambda: all(r in self.collect().finish or r in self.preempted for r in request_ids)


# The router's view of a worker, without Ray.


class _Ref:
    """An actor call's answer as Ray's ObjectRef gives it: `future()`, and awaitable."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def future(self) -> concurrent.futures.Future:
        return self._future

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()


class _Method:
    def __init__(self, actor: WorkerActor, fn: Callable):
        self.actor, self.fn = actor, fn

    def remote(self, *args) -> _Ref:
        if self.actor.dead:
            future = concurrent.futures.Future()
            future.set_exception(ray.exceptions.RayActorError())
            return _Ref(future)
        return _Ref(self.actor._calls.submit(self.actor._invoke, self.fn, args))


class WorkerActor:
    """A worker as `pdserve.cluster.actors`' shell shows it to the router: the same methods (`name.remote(...)`),
    msgpack payloads in and out, each call on a thread of its own, the worker's loop on another. After `die`
    every call, those under way included, raises RayActorError, as a dead actor's do; a decode worker's KV
    receiver goes with it (`FaultyHub.kill`). `before_call` / `before_reply`: called with a call's method name
    and arguments before the worker does it / once it has, before the answer goes back (a test delays a
    call or its answer there)."""

    def __init__(self, worker: PrefillWorker | DecodeWorker, hub: FaultyHub | None = None):
        self.worker, self.hub, self.dead = worker, hub, False
        self.before_call: Callable[[str, tuple], None] | None = None
        self.before_reply: Callable[[str, tuple], None] | None = None
        self._calls = concurrent.futures.ThreadPoolExecutor(16, f"{worker.worker_id}-call")
        self._stop = threading.Event()
        self._loop = threading.Thread(target=worker.run, args=(self._stop,), daemon=True)
        self._loop.start()
        for name in (
            "add_request",
            "submit",
            "abort",
            "poll_outputs",
            "poll_failures",
            "peer_lost",
        ):
            setattr(self, name, _Method(self, getattr(self, f"_{name}")))

    def _invoke(self, fn: Callable, args: tuple) -> bytes:
        if self.dead:
            raise ray.exceptions.RayActorError()
        name = fn.__name__.lstrip("_")
        if self.before_call is not None:
            self.before_call(name, args)
        out = fn(*args)
        if self.before_reply is not None:
            self.before_reply(name, args)
        if self.dead:
            raise ray.exceptions.RayActorError()
        return out

    def _add_request(self, payload: bytes) -> bytes:
        return messages.reply(
            lambda: self.worker.add_request(messages.decode(DecodeRequest, payload))
        )

    def _submit(self, payload: bytes) -> bytes:
        return messages.reply(lambda: self.worker.submit(messages.decode(PrefillRequest, payload)))

    def _abort(self, request_id: str) -> bytes:
        return messages.reply(lambda: self.worker.abort(request_id))

    def _peer_lost(self, decode_worker: str) -> bytes:
        return messages.reply(lambda: self.worker.peer_lost(decode_worker))

    def _poll_outputs(self, timeout_s: float) -> bytes:
        return messages.encode(self.worker.poll(timeout_s))

    def _poll_failures(self, timeout_s: float) -> bytes:
        return messages.encode(self.worker.poll(timeout_s))

    def die(self) -> None:
        """The actor's process dies: its calls fail from now on, its loop ends after the step under way."""
        self.dead = True
        if self.hub is not None:
            self.hub.kill(self.worker.worker_id)
        self._stop.set()

    def stop(self) -> None:
        """Ends the worker's loop and waits for the calls under way (a prefill worker's sends too)."""
        self._stop.set()
        self._loop.join(timeout=5)
        assert not self._loop.is_alive(), f"{self.worker.worker_id}'s loop did not stop"
        self._calls.shutdown(wait=True)
        self.worker.close()
