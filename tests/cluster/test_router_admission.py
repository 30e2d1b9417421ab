"""Admission in a burst: in its turn each request's reservation is sent, and the next turn begins before the
decode worker answers (`Admission._admit_at_once`), in arrival order; one the worker refuses waits in line for room
as before. The decode worker is a stand-in whose answers the test releases (no Ray)."""

from __future__ import annotations

import asyncio
import concurrent.futures

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.pools import DECODE, WorkerHandle, WorkerState
from pdserve.cluster.router import Router
from pdserve.engine import messages
from pdserve.engine.messages import DecodeRequest, Reservation
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.errors import CapacityError


class _Ref:
    def __init__(self):
        self._future = concurrent.futures.Future()

    def future(self):
        return self._future


class _AddRequest:
    """Records each call; its answer waits until the test sets it."""

    def __init__(self):
        self.calls: list[tuple[str, _Ref]] = []

    def remote(self, payload):
        ref = _Ref()
        self.calls.append((messages.decode(DecodeRequest, payload).request_id, ref))
        return ref


class _Actor:
    def __init__(self):
        self.add_request = _AddRequest()


def _decode_worker() -> WorkerHandle:
    w = WorkerHandle("decode-0", DECODE, _Actor(), None, 0, WorkerState.SERVING)
    w.num_pages, w.page_size = 100, 16
    return w


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_burst_is_sent_in_arrival_order_before_any_answer():
    async def run():
        router = Router(RouterConfig())
        d = _decode_worker()
        router.workers = {d.worker_id: d}
        requests = [
            router.open(f"c{i}", [3] * 40, SamplingParams(max_tokens=8, seed=1), None)
            for i in range(5)
        ]
        placing = [asyncio.create_task(router.admission.place(r, None)) for r in requests]
        await _settle()
        sent = [request_id for request_id, _ in d.actor.add_request.calls]
        assert sent == [r.request_id for r in requests]  # all under way at once, in order
        assert d.in_flight_pages == 5 * 3 and d.free_pages == 100 - 15
        for k, (_, ref) in enumerate(reversed(d.actor.add_request.calls)):  # answered in any order
            ref._future.set_result(messages.reply(lambda k=k: Reservation(k, 3)))
        await asyncio.gather(*placing)
        assert all(r.decode is d and r.admitted_at is not None for r in requests)
        assert d.in_flight_pages == 0 and d.reserved_pages == 15 and len(d.requests) == 5

    asyncio.run(run())


def test_a_refused_request_waits_in_line_and_is_sent_again():
    async def run():
        router = Router(RouterConfig(admission_timeout_s=5.0))
        d = _decode_worker()
        router.workers = {d.worker_id: d}
        r = router.open("c", [3] * 40, SamplingParams(max_tokens=8, seed=1), None)
        placing = asyncio.create_task(router.admission.place(r, None))
        await _settle()
        ((_, first),) = d.actor.add_request.calls
        first._future.set_result(messages.reply_error(CapacityError("decode worker full")))
        await _settle()
        assert len(d.actor.add_request.calls) == 2 and not placing.done()  # sent again, in line
        d.actor.add_request.calls[1][1]._future.set_result(
            messages.reply(lambda: Reservation(1, 3))
        )
        await placing
        assert r.decode is d and d.in_flight_pages == 0 and d.reserved_pages == 3

    asyncio.run(run())
