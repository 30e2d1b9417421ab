"""Drives requests through prefill and decode workers the way the router does, synchronously, for tests:
reserve pages on D, submit the prompt to P (or let D prefill locally), collect D's outputs, resubmit preempted
requests with the tokens generated so far, fail requests P reports failed. Workers are any objects with the
workers' methods: the real classes in this process, or proxies to other processes."""

from __future__ import annotations

import dataclasses
import time

from pdserve.engine.messages import DecodeRequest, PrefillRequest, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.errors import CapacityError


@dataclasses.dataclass
class Result:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    preemptions: int = 0
    first: RequestOutput | None = None
    """The first output with a token."""
    last: RequestOutput | None = None
    """The finishing output."""


class MiniRouter:
    def __init__(self, decode, decode_id: str, prefill=None, prefill_id: str | None = None):
        self.decode, self.decode_id, self.prefill, self.prefill_id = (
            decode,
            decode_id,
            prefill,
            prefill_id,
        )
        self.results: dict[str, Result] = {}
        self._prompts: dict[str, tuple[list[int], SamplingParams]] = {}
        self._pending: list[str] = []

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self._prompts[request_id] = (prompt, params.with_seed())
        self.results[request_id] = Result()
        self._pending.append(request_id)

    def abort(self, request_id: str) -> None:
        if request_id in self._pending:
            self._pending.remove(request_id)
            self.results[request_id].finish_reason = "abort"
            return
        if self.prefill is not None:
            self.prefill.abort(request_id)
        self.decode.abort(request_id)

    def _dispatch(self) -> None:
        for request_id in list(self._pending):
            prompt, params = self._prompts[request_id]
            generated = self.results[request_id].token_ids
            request = DecodeRequest(request_id, prompt, params, self.prefill_id, list(generated))
            try:
                reservation = self.decode.add_request(request)
            except CapacityError:
                return  # full: retry later, in order
            self._pending.remove(request_id)
            if self.prefill is not None:
                self.prefill.submit(PrefillRequest(
                    request_id, [*prompt, *generated], params, len(generated), self.decode_id,
                    reservation.transfer_id, num_held_pages=reservation.num_held_pages,
                ))  # fmt: skip

    def pump(self) -> None:
        self._dispatch()
        if self.prefill is not None:
            for failure in self.prefill.poll_failures():
                if failure.request_id not in self.results:
                    continue  # a request of an earlier run
                self.decode.abort(failure.request_id)
                self.results[failure.request_id].error = failure.error
        for out in self.decode.poll_outputs(0.01):
            result = self.results.get(out.request_id)
            if result is None:
                continue
            if out.preempted:
                result.preemptions += 1
                self._pending.append(out.request_id)
                continue
            if out.token_ids and result.first is None:
                result.first = out
            result.token_ids.extend(out.token_ids)
            if out.finish_reason is not None:
                result.last = out
                result.finish_reason = out.finish_reason
                result.error = result.error or out.error

    def done(self) -> bool:
        return all(r.finish_reason is not None for r in self.results.values())

    def run_until_done(self, timeout_s: float = 120.0, on_pump=None) -> dict[str, Result]:
        deadline = time.monotonic() + timeout_s
        while not self.done():
            if time.monotonic() > deadline:
                unfinished = [k for k, r in self.results.items() if r.finish_reason is None]
                raise TimeoutError(f"requests never finished: {unfinished}")
            self.pump()
            if on_pump is not None:
                on_pump(self)
        return self.results
