"""The router's placement of a request (`Admission`, an object the router owns): on which decode worker it runs and
which prefill worker computes its prompt, by the router's estimates of free pages and queued prompt tokens and,
with `router.prefix_aware_routing`, the prompt tokens each worker's prefix cache is expected to hold
(`prefix_routing`: the worker that computes the prompt, a prefill worker or a decode worker prefilling it); its
admission in arrival order when no decode worker has room (up to `router.admission_timeout_s`), or at once in a
burst (the reservation sent in its turn, the answer awaited after); and the tracking of every actor call made for
a request, so its cleanup waits for them and aborts it where it went."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import ray

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.errors import DeadlineExceededError, UnavailableError, WorkerLostError
from pdserve.cluster.pools import DECODE, PREFILL, WorkerHandle, WorkerState
from pdserve.cluster.prefix_routing import PromptHashes, rank_by_held, rank_by_prefix
from pdserve.cluster.request import Request
from pdserve.engine import messages
from pdserve.engine.checks import check_pages
from pdserve.engine.messages import DecodeRequest, PrefillRequest, Reservation
from pdserve.engine.pages import pages_needed
from pdserve.model.errors import CapacityError, InvalidRequestError, PdserveError

logger = logging.getLogger(__name__)

ADMISSION_RETRY_S = 0.05
"""How often a request waiting for room (or for a decode worker) looks again, at most."""


class Admission:
    """Places requests on the workers `pool` returns and admits them when there is room. It runs on the
    router's event loop; the router calls `place` for a request without a decode worker, `detach` when the
    request leaves its workers, `prefill_done` once its prompt is off the prefill worker, and `room_freed` when
    pages may have come free on a decode worker."""

    def __init__(
        self, config: RouterConfig, pool: Callable[..., list[WorkerHandle]],
        worker_lost: Callable[[WorkerHandle, str], None], replay_on_decode: bool = False,
    ):  # fmt: skip
        """pool(role, *states): the router's workers of `role` in those states. worker_lost(worker, reason):
        called when an actor call made here finds its worker dead (the router's `worker_lost`)."""
        self.config = config
        self._pool = pool
        self._worker_lost = worker_lost
        self.replay_on_decode = replay_on_decode
        """Batch-invariant mode: a moved request goes to a decode worker alone, which prefills its prompt and
        replays its generated tokens as decode rows (a prefill worker would compute them in the prefill
        kernels, whose last bits differ, and the stream would drift from what it would have been)."""
        self.num_replacing = {PREFILL: 0, DECODE: 0}
        """Replacements under way per role (the supervisor counts them): requests wait for a decode worker
        while one is coming."""
        self.restarts_stopped = ""
        """Why lost workers are no longer replaced (the supervisor's restart bound), or empty."""
        self._lock = asyncio.Lock()  # FIFO: requests are admitted in arrival order
        self._num_waiting = 0
        self._capacity = asyncio.Event()

    def room_freed(self) -> None:
        """Pages may have come free on a decode worker: requests waiting for room look again now."""
        self._capacity.set()

    def _check_fits(self, r: Request, decodes: list[WorkerHandle]) -> None:
        total = len(r.prompt_ids) + r.params.max_tokens
        largest = max(w.num_pages for w in decodes)
        try:
            check_pages(total, decodes[0].page_size, largest, "the largest decode worker")
        except CapacityError as e:  # no worker can ever hold it: the request is at fault
            raise InvalidRequestError("sampling_params.max_tokens", str(e)) from None

    async def place(
        self, r: Request, force: tuple[WorkerHandle | None, WorkerHandle] | None
    ) -> None:
        """Places `r` (reserves its pages on a decode worker and submits its prompt to a prefill worker, or
        none) once there is room, in arrival order; `force` pins the (P, D) pair (warm-up of new workers).
        Raises CapacityError (no room in time, or too many waiting), UnavailableError (no decode worker
        serving or coming), DeadlineExceededError, InvalidRequestError (no decode worker can ever hold it)."""
        if force is None:
            await self._wait_for_decode(r)
        self._check_fits(r, self._pool(DECODE, WorkerState.SERVING) or [force[1]])
        if self._num_waiting >= self.config.max_queued_requests:
            raise CapacityError(
                f"{self._num_waiting} requests are already waiting for a decode worker "
                f"(router.max_queued_requests)"
            )
        self._num_waiting += 1
        try:
            if force is not None or not await self._admit_at_once(r):
                while not await self._admit_in_turn(r, force):
                    await self._wait_for_decode(r)
        finally:
            self._num_waiting -= 1
        if r.admitted_at is None:
            r.admitted_at = time.monotonic()

    async def _admit_in_turn(self, r: Request, force) -> bool:
        """Admits `r` in arrival order, waiting for room up to admission_timeout_s; False when no decode
        worker serves any more. The caller then waits for one outside the admission lock: a replacement
        serves only once its warm-up request is through, and a warm-up (`force`) takes no turn in line."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.config.admission_timeout_s
        async with self._lock if force is None else contextlib.nullcontext():
            while not await self._try_admit(r, force):
                if force is None and not self._pool(DECODE, WorkerState.SERVING):
                    return False
                now = loop.time()
                if r.deadline is not None and now >= r.deadline:
                    raise DeadlineExceededError("deadline exceeded while waiting for admission")
                if now >= give_up:
                    raise CapacityError(
                        f"no decode worker had room for {len(r.prompt_ids) + len(r.generated)} "
                        f"tokens within {self.config.admission_timeout_s:g}s"
                    )
                self._capacity.clear()
                wait = min(ADMISSION_RETRY_S, give_up - now)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._capacity.wait(), wait)
        return True

    async def _wait_for_decode(self, r: Request) -> None:
        """Returns once a decode worker serves; while none does but a replacement is coming, waits for it
        (within the request's deadline). Raises UnavailableError when none serves and none is coming."""
        loop = asyncio.get_running_loop()
        while not self._pool(DECODE, WorkerState.SERVING):
            if not self.num_replacing[DECODE]:
                why = f": {self.restarts_stopped}" if self.restarts_stopped else ""
                raise UnavailableError(
                    f"no decode worker is serving (starting up, or all were lost{why})"
                )
            if r.deadline is not None and loop.time() >= r.deadline:
                raise DeadlineExceededError(
                    "deadline exceeded while waiting for a lost decode worker's replacement"
                )
            await asyncio.sleep(ADMISSION_RETRY_S)

    async def _admit_at_once(self, r: Request) -> bool:
        """Admits `r` without holding the line for the decode worker's answer: in its turn, when the estimates
        give the first choice room, the reservation is sent and the next request's turn begins; the answer is
        awaited after (a burst is admitted at the rate the router can send, not one Ray round trip per
        request). False when the estimates give no worker room or the worker refuses: `_admit_in_turn` then
        admits it, waiting in line for room."""
        async with self._lock:
            choice = self._choose(r, None)
            if choice is None:
                return False
            prefill, decodes, tokens, payload = choice
            d = decodes[0]
            need = pages_needed(len(tokens), d.page_size)
            if d.free_pages < need:
                return False
            d.in_flight_pages += need
            future = self._start_call(r, d, d.actor.add_request.remote(payload))
            self._expect(r, prefill or d)  # seen by the next request's choice, before the answer
            self._expect_held(r, d, prefill)
        try:
            reservation = messages.unwrap(Reservation, await self._end_call(r, d, future))
        except (CapacityError, WorkerLostError):
            return False
        finally:
            d.in_flight_pages -= need
        await self._reserved(r, d, reservation, prefill, tokens, None)
        return True

    def _choose(self, r: Request, force):
        """(prefill worker or None, decode workers in order of preference, the request's known tokens, the
        decode worker's request) by the router's estimates; None when no decode worker serves."""
        tokens = [*r.prompt_ids, *r.generated]
        if force is not None:
            prefill, decodes = force[0], [force[1]]
        else:
            decodes = sorted(
                self._pool(DECODE, WorkerState.SERVING),
                key=lambda w: (-w.free_pages, w.num_running),
            )
            if not decodes:  # all lost meanwhile: the caller waits for a replacement
                return None
            need = pages_needed(len(tokens), decodes[0].page_size)
            prefills = [w for w in self._pool(PREFILL, WorkerState.SERVING) if w.num_pages >= need]
            prefill = min(prefills, key=lambda w: w.queued_tokens, default=None)
            if r.generated and self.replay_on_decode:
                prefill = None
            elif prefill is not None and self.config.prefix_aware_routing:
                prefill = self._by_prefix(
                    r, sorted(prefills, key=lambda w: w.queued_tokens), tokens
                )[0]
            if prefill is None and self.config.prefix_aware_routing:  # D prefills it
                roomy = [d for d in decodes if d.free_pages >= need]
                ranked = self._by_prefix(r, roomy, tokens)
                decodes = ranked + [d for d in decodes if d.free_pages < need]
            elif self.config.prefix_aware_routing:  # D holds what it can of the prompt's KV
                decodes = self._by_held(r, decodes, tokens, need)
        peer = prefill.worker_id if prefill is not None else None
        payload = messages.encode(
            DecodeRequest(r.request_id, r.prompt_ids, r.params, peer, r.generated)
        )
        return prefill, decodes, tokens, payload

    def _by_prefix(
        self, r: Request, workers: list[WorkerHandle], tokens: list[int]
    ) -> list[WorkerHandle]:
        """`workers` best first by prefix-cache hit and load (`prefix_routing`); their expected hits go to
        `r.expected_hits`."""
        r.prompt_hashes = PromptHashes(tokens)
        ranked, r.expected_hits = rank_by_prefix(
            workers, r.prompt_hashes, lambda w: w.queued_tokens, self.config.prefix_load_weight,
            lambda w: w.prefix, self.config.prefix_host_hit_weight,
        )  # fmt: skip
        return ranked

    def _by_held(
        self, r: Request, decodes: list[WorkerHandle], tokens: list[int], need: int
    ) -> list[WorkerHandle]:
        """`decodes` best first by the pages of the prompt's KV each holds and its room (`prefix_routing`):
        those with room for what they do not hold first."""
        prompt = r.prompt_hashes = r.prompt_hashes or PromptHashes(tokens)
        held = {d: prompt.held_pages(d.prefix) for d in decodes}
        if not any(held.values()):
            return decodes
        roomy = [d for d in decodes if d.free_pages >= need - held[d]]
        ranked, _ = rank_by_held(
            roomy, prompt, lambda d: d.free_pages, lambda d: d.num_running,
            self.config.prefix_load_weight, lambda d: d.prefix,
        )  # fmt: skip
        return ranked + [d for d in decodes if d not in roomy]

    @staticmethod
    def _expect(r: Request, w: WorkerHandle) -> None:
        """`r`'s prompt is placed on `w` to prefill: its pages count as cached there from now on
        (`PrefixIndex.expect`)."""
        if r.prompt_hashes is not None and w.prefix is not None:
            w.prefix.expect(r.prompt_hashes.of(w.prefix), time.monotonic())

    @staticmethod
    def _expect_held(r: Request, d: WorkerHandle, prefill: WorkerHandle | None) -> None:
        """`r`'s KV goes from `prefill` to decode worker `d`, which keeps its prompt's pages when they
        arrive: they count as held there from now on (`PrefixIndex.expect`)."""
        if prefill is not None and d.prefix is not None and d.prefix.reuse_held:
            r.prompt_hashes = r.prompt_hashes or PromptHashes([*r.prompt_ids, *r.generated])
            d.prefix.expect(r.prompt_hashes.of(d.prefix, d.prefix.held_root), time.monotonic())

    async def _try_admit(self, r: Request, force) -> bool:
        choice = self._choose(r, force)
        if choice is None:
            return False
        prefill, decodes, tokens, payload = choice
        for d in decodes:
            try:
                reply = await self._call(r, d, d.actor.add_request.remote(payload))
                reservation = messages.unwrap(Reservation, reply)
            except (CapacityError, WorkerLostError):
                continue
            break
        else:
            return False
        await self._reserved(r, d, reservation, prefill, tokens, force)
        return True

    async def _reserved(
        self, r: Request, d: WorkerHandle, reservation: Reservation,
        prefill: WorkerHandle | None, tokens: list[int], force,
    ) -> None:  # fmt: skip
        """Decode worker `d` reserved room for `r`: it is placed there, and its prompt goes to `prefill` (None:
        `d` prefills it)."""
        r.decode, r.decode_worker = d, d.worker_id
        d.requests.add(r.request_id)
        d.reserved_pages += reservation.num_pages
        r.prefill_worker = prefill.worker_id if prefill is not None else ""
        # the prompt tokens left to compute count in the queue of the worker that computes them
        r.prefilling_on = prefill or d
        r.prefill_tokens = len(tokens) - r.expected_hits.get(r.prefilling_on, 0)
        r.prefilling_on.queued_tokens += r.prefill_tokens
        self._expect(r, r.prefilling_on)
        self._expect_held(r, d, prefill)
        r.expected_hits, r.prompt_hashes = {}, None
        if prefill is None:
            return
        r.prefill = prefill
        prefill.requests.add(r.request_id)
        request = PrefillRequest(
            r.request_id, tokens, r.params, len(r.generated), reservation.endpoint or r.decode_worker,
            reservation.transfer_id, reservation.dest_cuts, reservation.num_held_pages,
        )  # fmt: skip
        try:
            messages.unwrap(
                None,
                await self._call(r, prefill, prefill.actor.submit.remote(messages.encode(request))),
            )
        except WorkerLostError:
            if force is not None:
                await asyncio.gather(d.actor.abort.remote(r.request_id), return_exceptions=True)
                self.detach(r)
                raise
            # The prefill worker died under the submit: the request's _Lost is queued, it migrates.
        except PdserveError:
            await asyncio.gather(d.actor.abort.remote(r.request_id), return_exceptions=True)
            self.detach(r)
            raise

    async def _call(self, r: Request, w: WorkerHandle, ref) -> bytes:
        """Awaits an actor call made for `r`. A cancelled caller leaves the call running; cleanup waits for it."""
        return await self._end_call(r, w, self._start_call(r, w, ref))

    @staticmethod
    def _start_call(r: Request, w: WorkerHandle, ref) -> asyncio.Future:
        """Tracks an actor call made for `r` (its cleanup waits for it and aborts on `w`) from now on."""
        future = asyncio.wrap_future(ref.future())
        r.touched.add(w)
        r.calls.add(future)
        future.add_done_callback(r.calls.discard)
        return future

    async def _end_call(self, r: Request, w: WorkerHandle, future: asyncio.Future) -> bytes:
        """The answer of a call `_start_call` tracks; WorkerLostError when `w` died (it is reported lost)."""
        try:
            return await asyncio.shield(future)
        except ray.exceptions.RayError as e:
            self._worker_lost(w, str(e).splitlines()[0])
            raise WorkerLostError(f"{w.role} worker {w.worker_id} died") from e

    def prefill_done(self, r: Request) -> None:
        """`r`'s prompt is off its prefill worker (its first token came): the worker's queue estimate drops it."""
        if r.prefill is not None:
            r.prefill.requests.discard(r.request_id)
            r.prefill = None
        if r.prefilling_on is not None:
            r.prefilling_on.queued_tokens -= r.prefill_tokens
            r.prefilling_on, r.prefill_tokens = None, 0

    def detach(self, r: Request) -> None:
        """`r` leaves the workers it is placed on (in the router's estimates; the workers are not told)."""
        self.prefill_done(r)
        if r.decode is not None:
            r.decode.requests.discard(r.request_id)
            r.decode = None
            self._capacity.set()
