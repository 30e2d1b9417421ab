"""BENCHMARK ONLY: a decode worker actor that runs no model (`cluster.benchmark_fake_decode_ms` > 0), so that the
front ends (router relay, gRPC and HTTP streaming) can be measured alone at rates no real model reaches on a CPU.

It speaks the decode shell's protocol (`actors.DecodeShell`: ready, add_request, poll_outputs, abort, stats,
close) and reserves no memory. Ticks fall on a fixed grid of the node's monotonic clock: tick n at
n * interval seconds. At each tick every running request gets `tokens_per_tick` tokens, all the single-token
symbol SYMBOLS[n mod 62] (digits, then lower- and upper-case letters), in one output; the request ends with
finish reason length at max_tokens. A client on the same node finds each chunk's emission time from its arrival
time and its symbol (the latest grid time before arrival with that symbol), unambiguously while the front end
adds less than 62 intervals. Aggregated only: requests
are never prefilled, so `num_prefill` must be 0 (the config refuses it otherwise)."""

from __future__ import annotations

import logging
import math
import os
import threading
import time

from pdserve.cluster.config import ModelConfig
from pdserve.engine import messages
from pdserve.engine.messages import (
    DecodePoll,
    DecodeRequest,
    DecodeStats,
    RequestOutput,
    Reservation,
)
from pdserve.engine.pages import pages_needed
from pdserve.engine.sampling_params import FinishReason
from pdserve.model.errors import ConfigError

logger = logging.getLogger(__name__)

SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""What tick n emits: SYMBOLS[n % len(SYMBOLS)]."""
PAGE_SIZE = 64
NUM_PAGES = 1 << 20
"""Room it claims: admission never waits on it."""


def symbol_token_ids(model_path: str) -> list[int]:
    """The token ids of SYMBOLS in the checkpoint's tokenizer; ConfigError unless each is one token that
    decodes to itself."""
    from pdserve.model.random_checkpoint import resolve_model
    from pdserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(model_path))
    ids = [tokenizer.encode(c, add_bos=False) for c in SYMBOLS]
    bad = [c for c, x in zip(SYMBOLS, ids, strict=True) if len(x) != 1 or tokenizer.decode(x) != c]
    if bad:
        raise ConfigError(
            f"cluster.benchmark_fake_decode_ms needs a tokenizer with one token for each of {SYMBOLS}; "
            f"{model_path}'s has none for {''.join(bad)}"
        )
    return [x[0] for x in ids]


class _Running:
    __slots__ = ("request_id", "remaining")

    def __init__(self, request_id: str, remaining: int):
        self.request_id, self.remaining = request_id, remaining


class FixedRateDecodeShell:
    """The actor (pools applies `ray.remote`). Its emitter thread ticks on the grid; a tick that comes late
    emits at once and counts in `num_late_ticks` (stats log it at close)."""

    role = "decode"

    def __init__(
        self, worker_id: str, model: ModelConfig, interval_ms: float, tokens_per_tick: int
    ):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        self.worker_id = worker_id
        self.interval_s = interval_ms / 1e3
        self.tokens_per_tick = tokens_per_tick
        self._init_error: BaseException | None = None
        try:
            self.symbols = symbol_token_ids(model.path)
        except Exception as e:  # process boundary: reported by ready()
            self._init_error = e
        self._running: dict[str, _Running] = {}
        self._outputs: list[RequestOutput] = []
        self._pages_used = 0
        self._pages: dict[str, int] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.num_ticks = self.num_late_ticks = 0
        self._thread = threading.Thread(target=self._emit, name=f"{worker_id}-emitter", daemon=True)
        if self._init_error is None:
            self._thread.start()
        logger.warning(
            "%s: BENCHMARK-ONLY decode worker: no model, %d symbol token(s) per request every %g ms",
            worker_id, tokens_per_tick, interval_ms,
        )  # fmt: skip

    def _emit(self) -> None:
        tick = math.floor(time.monotonic() / self.interval_s) + 1
        while not self._stop.is_set():
            due = tick * self.interval_s
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            elif wait < -self.interval_s:
                # more than a tick behind: emit now, as a late real step would, rather than catch up
                self.num_late_ticks += 1
                tick = math.floor(time.monotonic() / self.interval_s)
            token = self.symbols[tick % len(SYMBOLS)]
            with self._cond:
                for r in list(self._running.values()):
                    n = min(self.tokens_per_tick, r.remaining)
                    r.remaining -= n
                    finish = FinishReason.LENGTH if r.remaining == 0 else None
                    self._outputs.append(RequestOutput(r.request_id, [token] * n, finish))
                    if finish is not None:
                        self._release(r.request_id)
                if self._outputs:
                    self._cond.notify_all()
            self.num_ticks += 1
            tick += 1

    def _release(self, request_id: str) -> None:
        self._running.pop(request_id, None)
        self._pages_used -= self._pages.pop(request_id, 0)

    def ready(self) -> bytes:
        import ray

        if self._init_error is not None:
            return messages.reply_error(self._init_error)
        return messages.reply(lambda: {
            "node_ip": ray.util.get_node_ip_address(),
            "device": "cpu (benchmark only: fixed-rate symbols, no model)",
            "num_pages": NUM_PAGES,
            "page_size": PAGE_SIZE,
            "pid": os.getpid(),
            "rank_pids": [],
        })  # fmt: skip

    def add_request(self, request: bytes) -> bytes:
        def add() -> Reservation:
            r = messages.decode(DecodeRequest, request)
            total = len(r.prompt_token_ids) + r.params.max_tokens
            num_pages = pages_needed(total, PAGE_SIZE)
            with self._cond:
                self._pages[r.request_id] = num_pages
                self._pages_used += num_pages
                remaining = r.params.max_tokens - len(r.generated_token_ids)
                self._running[r.request_id] = _Running(r.request_id, remaining)
            return Reservation(transfer_id=0, num_pages=num_pages)

        return messages.reply(add)

    def poll_outputs(self, timeout_s: float) -> bytes:
        with self._cond:
            if not self._outputs:
                self._cond.wait(timeout_s)
            outputs, self._outputs = self._outputs, []
        return messages.encode(DecodePoll(outputs))

    def abort(self, request_id: str) -> bytes:
        def abort() -> None:
            with self._cond:
                self._release(request_id)

        return messages.reply(abort)

    def stats(self) -> bytes:
        def stats() -> DecodeStats:
            with self._cond:
                return DecodeStats(
                    self.worker_id, len(self._running), 0, self._pages_used, NUM_PAGES,
                    len(self._running), PAGE_SIZE, 0,
                )  # fmt: skip

        return messages.reply(stats)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        logger.info(
            "%s: %d ticks, %d more than a tick late", self.worker_id, self.num_ticks,
            self.num_late_ticks,
        )  # fmt: skip
