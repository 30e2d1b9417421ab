"""Where the router places a request that moves with tokens already sent: in batch-invariant mode
(`Admission.replay_on_decode`) on a decode worker alone, which prefills its prompt and replays those tokens as decode
rows; otherwise through a prefill worker as a new prompt would. The workers are stand-ins that record the calls
(the placement is the router's alone; tests/cluster/test_survive.py runs the real thing)."""

from __future__ import annotations

import asyncio
import concurrent.futures

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.pools import DECODE, PREFILL, WorkerHandle, WorkerState
from pdserve.cluster.router import Router
from pdserve.engine import messages
from pdserve.engine.messages import DecodeRequest, PrefillRequest, Reservation
from pdserve.engine.sampling_params import SamplingParams


class _Ref:
    def __init__(self, value):
        self._future = concurrent.futures.Future()
        self._future.set_result(value)

    def future(self):
        return self._future


class _Method:
    def __init__(self, calls: list, reply):
        self.calls, self.reply = calls, reply

    def remote(self, payload):
        self.calls.append(payload)
        return _Ref(self.reply)


class _Actor:
    def __init__(self):
        self.added: list[bytes] = []
        self.submitted: list[bytes] = []
        self.add_request = _Method(self.added, messages.reply(lambda: Reservation(7, 2)))
        self.submit = _Method(self.submitted, messages.reply(lambda: None))


def _worker(worker_id: str, role: str) -> WorkerHandle:
    w = WorkerHandle(worker_id, role, _Actor(), None, 0, WorkerState.SERVING)
    w.num_pages, w.page_size = 64, 16
    return w


def _place(replay_on_decode: bool, generated: list[int]):
    async def run():
        router = Router(RouterConfig(), replay_on_decode=replay_on_decode)
        prefill, decode = _worker("prefill-0", PREFILL), _worker("decode-0", DECODE)
        router.workers = {w.worker_id: w for w in (prefill, decode)}
        r = router.open("client", [3, 4, 5, 6], SamplingParams(max_tokens=16, seed=1), None)
        r.generated = list(generated)
        assert await router.admission._try_admit(r, None)
        (added,) = [messages.decode(DecodeRequest, p) for p in decode.actor.added]
        submitted = [messages.decode(PrefillRequest, p) for p in prefill.actor.submitted]
        return added, submitted

    return asyncio.run(run())


def test_a_moved_request_replays_on_the_decode_worker_in_batch_invariant_mode():
    added, submitted = _place(True, [40, 41])
    assert added.prefill_peer is None and submitted == []
    assert added.prompt_token_ids == [
        3,
        4,
        5,
        6,
    ]  # the tokens already sent go with it to be replayed


def test_otherwise_a_prefill_worker_prefills_it_with_the_tokens_already_sent():
    added, (submitted,) = _place(False, [40, 41])
    assert added.prefill_peer == "prefill-0"
    assert submitted.token_ids == [3, 4, 5, 6, 40, 41] and submitted.num_generated == 2
    added, (submitted,) = _place(True, [])  # a new request: as ever
    assert added.prefill_peer == "prefill-0" and submitted.num_generated == 0
