"""A caller that fell behind the decode steps gets the queued outputs of its request merged into one chunk, up to
(not past) a preemption, an abort or a failure, which it gets next; outputs of a submission that migrated away are
dropped; a first output is relayed as it comes, with its first token's log-probabilities, the stage times of
every output merge, and the speculation counts of each stay on a decode worker add up. No worker is called: the
request sits on a decode worker handle and its outputs are queued as the router's poller queues them."""

from __future__ import annotations

import asyncio

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.pools import DECODE, WorkerHandle
from pdserve.cluster.router import Router
from pdserve.engine.messages import PrefillFailure, RequestOutput, SpecCounts, StageTimes
from pdserve.engine.sampling_params import SamplingParams, TokenLogprobs


def _placed(router: Router):
    r = router.open("client", [0, 1, 2], SamplingParams(max_tokens=16), None)
    decode = WorkerHandle("decode-0", DECODE, None, None, 0)
    r.decode, r.decode_worker = decode, decode.worker_id
    decode.requests.add(r.request_id)
    return r, decode


def test_queued_outputs_merge_until_a_finish():
    async def run():
        router = Router(RouterConfig())
        r, decode = _placed(router)
        for out in (
            RequestOutput(r.request_id, [5]),
            RequestOutput("req-old.1", [99]),  # a submission that migrated away
            RequestOutput(r.request_id, [6, 7]),
            RequestOutput(r.request_id, [8], "length"),
            RequestOutput(r.request_id, [9]),  # never reached: the request finished
        ):
            r.events.put_nowait(out)
        out = await router.next_tokens(r)
        assert (out.token_ids, out.finish_reason) == ([5, 6, 7, 8], "length")
        assert r.generated == [5, 6, 7, 8] and r.finish_reason == "length"
        assert r.first_token_at is not None and not decode.requests
        assert await router.next_tokens(r) is None

    asyncio.run(run())


def test_merging_stops_before_a_failure_which_comes_next():
    async def run():
        router = Router(RouterConfig())
        r, _ = _placed(router)
        r.events.put_nowait(RequestOutput(r.request_id, [5]))
        r.events.put_nowait(RequestOutput(r.request_id, [6]))
        r.events.put_nowait(PrefillFailure(r.request_id, "boom"))
        r.events.put_nowait(RequestOutput(r.request_id, [7]))
        out = await router.next_tokens(r)
        assert out.token_ids == [5, 6] and out.finish_reason is None
        assert isinstance(r.pending, PrefillFailure)
        assert isinstance(await router._next_event(r), PrefillFailure) and r.pending is None
        out = await router.next_tokens(r)  # the failure was taken above: the next output follows
        assert out.token_ids == [7]

    asyncio.run(run())


def test_outputs_relay_as_they_come_and_their_stages_merge():
    async def run():
        router = Router(RouterConfig())
        r, _ = _placed(router)
        on_prefill = StageTimes(prefill_queue_s=0.25, prefill_s=0.5, kv_transfer_s=0.125)
        first = RequestOutput(r.request_id, [5], logprobs=[TokenLogprobs(-0.5)], stages=on_prefill)
        r.events.put_nowait(first)
        # relayed as it came: nothing waits on the prefill worker
        assert await router.next_tokens(r) == first
        assert r.stages == on_prefill
        # merged while queued: the first output's stages and the last one's
        r.events.put_nowait(RequestOutput(r.request_id, [6], stages=StageTimes(prefill_s=1.0)))
        r.events.put_nowait(RequestOutput(r.request_id, [7]))
        last = StageTimes(decode_queue_s=0.0625)
        r.events.put_nowait(RequestOutput(r.request_id, [8], "length", stages=last))
        out = await router.next_tokens(r)
        assert out.token_ids == [6, 7, 8] and out.stages == StageTimes(0.0, 1.0, 0.0, 0.0625)
        assert r.stages == StageTimes(0.25, 1.0, 0.125, 0.0625)

    asyncio.run(run())


def test_the_speculation_of_each_stay_on_a_decode_worker_adds_up():
    async def run():
        router = Router(RouterConfig())
        r, decode = _placed(router)

        async def place_again(request, force):  # the admission's placement, on the same worker
            request.decode = decode

        router.admission.place = place_again
        first, second = r.request_id, f"{r.request_id}.1"
        for out in (
            RequestOutput(first, [5]),
            RequestOutput(first, [], preempted=True, spec=SpecCounts(4, 2, 2)),
            RequestOutput(first, [], preempted=True, spec=SpecCounts(1, 1, 1)),  # stale: dropped
            RequestOutput(second, [6]),
            RequestOutput(second, [7], "length", spec=SpecCounts(3, 3, 1)),
        ):
            r.events.put_nowait(out)
        assert (await router.next_tokens(r)).token_ids == [5] and r.spec is None
        out = await router.next_tokens(r)  # placed again, then its outputs merged
        assert r.request_id == second and r.num_preemptions == 1
        assert out.token_ids == [6, 7] and out.spec == SpecCounts(3, 3, 1)
        assert r.spec == SpecCounts(7, 5, 3)

    asyncio.run(run())
