"""The router over real prefill and decode workers without a model or Ray (`tests/model_free.py`): a request a
worker fails moves and streams on unchanged, a lost decode worker's requests move, a cancelled request is aborted
on every worker it touched, and every page comes back on every worker still up."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import ray
from model_free import (
    PAGE,
    FaultyHub,
    WorkerActor,
    decode_worker,
    prefill_worker,
    reference,
)

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.errors import WorkerFailedError
from pdserve.cluster.pools import DECODE, PREFILL, WorkerHandle, WorkerState
from pdserve.cluster.router import Router
from pdserve.engine.request import RequestState
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timed

PROMPT = list(range(3, 14))
HANG_S = 10.0
"""How long a wait may take before the test calls it a hang: far above what any takes unloaded (milliseconds), as a
loaded CI machine may hold a thread for seconds."""


class Cluster:
    """A router over in-process workers p0, d0 (and d1), all joined by one `FaultyHub`."""

    def __init__(
        self, decodes: int = 1, kv_wait_timeout_s: tuple[float, ...] = (5.0, 5.0),
        send_timeout_s: float = 2.0, decode_pages: int = 32, prefills: int = 1,
    ):  # fmt: skip
        """kv_wait_timeout_s: d0's, d1's; prefills: 0 or 1 (p0)."""
        self.hub = FaultyHub()
        self.router = Router(
            RouterConfig(poll_timeout_s=0.02, admission_timeout_s=HANG_S, migration_limit=2)
        )
        self.lost: list[str] = []
        self.router.on_worker_lost = lambda w, reason, state: self.lost.append(w.worker_id)
        workers = [prefill_worker(self.hub, send_timeout_s=send_timeout_s)][:prefills]
        workers += [
            decode_worker(
                self.hub,
                f"d{i}",
                num_pages=decode_pages,
                kv_wait_timeout_s=kv_wait_timeout_s[i],
            )  # fmt: skip
            for i in range(decodes)
        ]
        self.actors = {w.worker_id: WorkerActor(w, self.hub) for w in workers}
        self.handles: dict[str, WorkerHandle] = {}

    def start(self) -> None:
        """On the router's loop: the workers join, serving."""
        for worker_id, actor in self.actors.items():
            role = PREFILL if worker_id.startswith("p") else DECODE
            w = WorkerHandle(worker_id, role, actor, None, 0, WorkerState.SERVING)
            w.num_pages, w.page_size = actor.worker.num_pages, PAGE
            self.handles[worker_id] = w
            self.router.add_worker(w)

    def worker(self, worker_id: str):
        return self.actors[worker_id].worker

    async def settle(self, timeout_s: float = HANG_S) -> None:
        """Waits until every worker still up holds no request and no page."""
        give_up = time.monotonic() + timeout_s
        while True:
            busy = {
                a.worker.worker_id: a.worker.num_used_pages
                for a in self.actors.values()
                if not a.dead and (a.worker.num_used_pages or a.worker.scheduler.requests)
            }
            if not busy:
                return
            assert time.monotonic() < give_up, f"pages or requests left on {busy}"
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        await self.router.close_all()
        for actor in self.actors.values():
            actor.stop()


async def until(condition, what: str, timeout_s: float = HANG_S) -> None:
    give_up = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up, f"{what} did not happen within {timeout_s:g}s"
        await asyncio.sleep(0.002)


def state_on(worker, request_id: str) -> RequestState | None:
    request = worker.scheduler.requests.get(request_id)
    return None if request is None else request.state


async def stream(router: Router, r, on_output=None) -> list[int]:
    """The request's tokens to its end (closed either way), as a front end streams it."""
    tokens: list[int] = []
    try:
        while (out := await router.next_tokens(r)) is not None:
            tokens += out.token_ids
            if on_output is not None:
                on_output(tokens)
    finally:
        router.close(r)
    return tokens


def run(test, **cluster):
    """Runs `test(cluster)` on a fresh event loop, with the cluster closed after."""

    async def main():
        c = Cluster(**cluster)
        c.start()
        try:
            await asyncio.wait_for(test(c), 3 * HANG_S)
        finally:
            await c.close()

    ray_before = (
        ray.is_initialized()
    )  # an xdist worker may hold the session's Ray from earlier tests
    asyncio.run(main())
    assert ray.is_initialized() == ray_before  # the router ran without starting Ray


def test_requests_stream_the_reference_tokens_and_free_every_page():
    async def test(c: Cluster):
        params = [SamplingParams(max_tokens=n, seed=n) for n in (5, 9, 3)]
        prompts = [PROMPT, list(range(20, 40)), [7]]
        requests = [
            c.router.open(f"c{i}", p, s, None)
            for i, (p, s) in enumerate(zip(prompts, params, strict=True))
        ]
        got = await asyncio.gather(*(stream(c.router, r) for r in requests))
        assert got == [reference(p, s.max_tokens) for p, s in zip(prompts, params, strict=True)]
        assert all(r.num_migrations == 0 and r.prefill_worker == "p0" for r in requests)
        await c.settle()

    run(test)


@pytest.mark.parametrize(
    "first", ["p0's send timeout", "d0's deadline"], ids=["send-timeout", "kv-deadline"]
)
def test_a_failed_transfer_moves_the_request_and_its_stream_goes_on(first):
    async def test(c: Cluster):
        c.hub.fault("d0", 1, drop=True)  # the first transfer to d0 never comes
        r = c.router.open("c", PROMPT, SamplingParams(max_tokens=6, seed=1), None)
        assert await stream(c.router, r) == reference(PROMPT, 6)
        assert r.num_migrations == 1 and r.request_id == "req-0.1"
        await c.settle()  # p0's timed-out send freed its pages too
        assert c.worker("p0").stats().num_send_failures == 1

    if first == "p0's send timeout":
        run(test, send_timeout_s=0.1)
    else:  # the request moves to d1 (the router reckons d0's pages still reserved), which waits longer
        run(test, decodes=2, kv_wait_timeout_s=(0.1, 5.0), send_timeout_s=0.2)


def test_a_lost_decode_worker_s_requests_move_and_go_on_from_where_they_were():
    async def test(c: Cluster):
        d0, gate = c.worker("d0"), threading.Event()
        # d0 stops after a few steps until it dies: it dies mid-stream, however slow the machine
        d0.runner.on_execute = lambda plan: len(d0.runner.plans) < 5 or gate.wait(5)
        params = SamplingParams(max_tokens=40, seed=4)
        r = c.router.open("c", PROMPT, params, None)
        died = []

        def kill_d0(tokens):
            if len(tokens) >= 3 and not died:
                died.append(len(tokens))
                c.actors[r.decode_worker].die()
                gate.set()

        tokens = await stream(c.router, r, kill_d0)
        assert tokens == reference(PROMPT, 40)  # no token lost or repeated
        assert died and c.lost == ["d0"] and r.decode_worker == "d1" and r.num_migrations == 1
        assert c.handles["d0"].state == WorkerState.DEAD and "d0" not in c.router.workers
        await c.settle()

    run(test, decodes=2)


def test_a_request_its_decode_worker_prefills_streams_from_its_first_token():
    """Without a prefill worker the decode worker's first outputs may come before the router has the answer
    to its reservation: they are the request's all the same."""

    async def test(c: Cluster):
        d0 = c.worker("d0")

        def late_answer(method, args):  # the reservation's answer comes after the first tokens
            if method == "add_request":
                give_up = time.monotonic() + 1
                while not all(r.num_generated >= 2 for r in d0.scheduler.requests.values()):
                    assert time.monotonic() < give_up
                    time.sleep(0.001)

        c.actors["d0"].before_reply = late_answer
        r = c.router.open("c", PROMPT, SamplingParams(max_tokens=6, seed=1), None)
        assert await stream(c.router, r) == reference(PROMPT, 6)
        await c.settle()

    run(test, prefills=0)


def test_a_decode_worker_lost_mid_transfer_fails_the_send_and_the_request_moves():
    async def test(c: Cluster):
        held = c.hub.hold("d0", 1)  # the transfer is under way when d0 dies
        r = c.router.open("c", PROMPT, SamplingParams(max_tokens=6, seed=1), None)
        p0 = c.worker("p0")
        task = asyncio.create_task(stream(c.router, r))
        await until(lambda: state_on(p0, r.request_id) is RequestState.SENDING, "p0 sending")
        c.actors["d0"].die()
        assert await task == reference(
            PROMPT, 6
        )  # moved on p0's failure or d0's loss, whichever came first
        assert r.decode_worker == "d1" and r.num_migrations == 1
        assert p0.stats().num_send_failures == 1  # failed at d0's death, not after its timeout
        await until(lambda: c.lost == ["d0"], "d0's loss")  # the router's next poll of it
        await c.settle()
        assert not held.is_set()

    run(test, decodes=2, send_timeout_s=30.0)


def test_a_lost_prefill_worker_s_request_is_prefilled_by_its_decode_worker():
    async def test(c: Cluster):
        p0, gate = c.worker("p0"), threading.Event()
        p0.runner.on_execute = lambda plan: gate.wait(5)  # p0 dies with the prompt in its pass
        r = c.router.open("c", PROMPT, SamplingParams(max_tokens=6, seed=1), None)
        task = asyncio.create_task(stream(c.router, r))
        await until(lambda: state_on(p0, r.request_id) is RequestState.PREFILLING, "p0 prefilling")
        c.actors["p0"].die()
        gate.set()
        assert await task == reference(PROMPT, 6)
        assert c.lost == ["p0"] and r.num_migrations == 1 and r.prefill_worker == ""
        await c.settle()

    run(test)


def test_preempted_requests_are_placed_again_and_go_on_unchanged():
    async def test(c: Cluster):
        # three 8-token prompts reserve 6 of d0's 8 pages; each grows to 6 pages: some are preempted
        params = SamplingParams(max_tokens=14, seed=1)
        prompts = [list(range(i, i + 8)) for i in (3, 20, 40)]
        requests = [c.router.open(f"c{i}", p, params, None) for i, p in enumerate(prompts)]
        got = await asyncio.gather(*(stream(c.router, r) for r in requests))
        assert got == [reference(p, 14) for p in prompts]
        assert sum(r.num_preemptions for r in requests) > 0
        assert c.worker("d0").stats().num_preemptions > 0
        await c.settle()

    run(test, decode_pages=8)


def test_a_request_preempted_before_its_prefill_worker_had_the_acknowledgement_is_placed_again():
    async def test(c: Cluster):
        ack = threading.Event()  # p0's sends return only once d0's preemptions are under way
        for transfer_id in (1, 2, 3):
            c.hub.fault("d0", transfer_id, ack=ack)
        params = SamplingParams(max_tokens=14, seed=1)
        prompts = [list(range(i, i + 8)) for i in (3, 20, 40)]
        requests = [c.router.open(f"c{i}", p, params, None) for i, p in enumerate(prompts)]
        tasks = [asyncio.create_task(stream(c.router, r)) for r in requests]
        await until(
            lambda: any(r.num_preemptions and r.decode for r in requests), "a new placement"
        )
        c.hub.release(ack)
        assert await asyncio.gather(*tasks) == [reference(p, 14) for p in prompts]
        await c.settle()

    run(test, decode_pages=8)


@pytest.mark.parametrize("where", ["placing", "prefilling", "sending", "decoding"])
def test_cancellation_aborts_the_request_on_every_worker(where):
    """The worker in the way is stopped (a step or a send held) until the aborts have landed: without them
    it would hold the request for good (d0), or prefill and send it (p0). Placing: d0 takes the reservation
    after the cancel; the abort must wait for it."""

    async def test(c: Cluster):
        p0, d0 = c.worker("p0"), c.worker("d0")
        gate = threading.Event()
        if where == "prefilling":
            p0.runner.on_execute = lambda plan: gate.wait(5)
        elif where == "sending":
            gate = c.hub.hold("d0", 1)
        elif where == "placing":
            c.actors["d0"].before_call = lambda method, args: (
                method != "add_request" or gate.wait(5)
            )
        else:
            d0.runner.on_execute = lambda plan: len(d0.runner.plans) < 3 or gate.wait(5)
        r = c.router.open("c", PROMPT, SamplingParams(max_tokens=100, seed=1), None)
        task = asyncio.create_task(stream(c.router, r))
        state = {"prefilling": RequestState.PREFILLING, "sending": RequestState.SENDING}
        if where == "placing":
            await until(lambda: r.calls, "d0's reservation under way")
        elif where in state:
            await until(lambda: state_on(p0, r.request_id) is state[where], f"p0 {where}")
        else:
            await until(lambda: len(r.generated) >= 2, "d0 decoding")
        task.cancel()  # the client went away
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if where == "placing":
            # an abort that did not wait for the reservation's call would land meanwhile
            await asyncio.sleep(0.05)
            c.hub.release(gate)
            await until(lambda: not r.calls, "d0's answer")
        await until(lambda: not d0.scheduler.requests, "d0's abort")
        if where != "sending":  # a send under way completes (the decode side discards it)
            await until(lambda: not p0.scheduler.requests, "p0's abort")
        c.hub.release(gate)
        await c.settle()
        assert r.request_id not in c.router.requests and len(r.generated) < 100
        if where == "prefilling":
            assert not c.hub.delivered and not p0.poll_failures()

    run(test)


def test_a_failed_forward_pass_fails_the_request_and_it_is_cleaned_up_everywhere():
    async def test(c: Cluster):
        c.worker("p0").runner.fail_prefill = "injected fault"
        r = c.router.open("c", PROMPT, SamplingParams(max_tokens=6, seed=1), None)
        with pytest.raises(WorkerFailedError, match="prefill failed: injected fault"):
            await stream(c.router, r)
        await c.settle()  # d0's reservation freed by the router's abort

    run(test)
