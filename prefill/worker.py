"""`PrefillWorker`: computes prompts' KV caches and first tokens and hands them to decode workers.

A plain class (Ray wraps it in pdserve.cluster). Control calls (`submit`, `abort`, `stats`) may come from any
thread; `step` runs on the worker's loop thread. Finished prompts are sent by a small thread pool, one send at a
time per decode peer; a prompt's pages are freed when its decode worker acknowledges or the send fails. Failures
are reported through `poll_events` and fail only the requests involved.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve import kernels
from pdserve.engine.messages import PrefillFailure, PrefillRequest, PrefillStats
from pdserve.engine.worker import Worker
from pdserve.kvtransfer import KVSender
from pdserve.model.batch import SeqChunk
from pdserve.model.deepseek import Transformer
from pdserve.model.errors import PdserveError
from pdserve.model.runner import SampleSpec

from .config import PrefillConfig
from .scheduler import PrefillScheduler, PrefillSeq, PrefillState

logger = logging.getLogger(__name__)


class PrefillWorker(Worker):
    def __init__(
        self, worker_id: str, model: Transformer, config: PrefillConfig, sender: KVSender,
        kv_cache_dtype: str = "auto",
    ):  # fmt: skip
        """kv_cache_dtype: auto or fp8 (`pdserve.model.kv_cache`); must be the decode workers'."""
        super().__init__(worker_id, model, config, kv_cache_dtype)
        self.sender = sender
        self.scheduler = PrefillScheduler(
            self.allocator, config.page_size, config.max_num_batched_tokens,
            config.max_prefill_chunk, model.args.vocab_size, kernels.batch_invariant(),
        )  # fmt: skip
        self._aborted: set[str] = set()
        self._failures: list[PrefillFailure] = []
        self._sends = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"{worker_id}-send")

    def submit(self, request: PrefillRequest) -> None:
        """Queues a prompt. Raises InvalidRequestError / CapacityError when it cannot ever run here."""
        with self._lock:
            self.scheduler.add(request)
        self.sender.connect(request.decode_peer)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Drops a request. A send already under way completes (the decode side discards it) first."""
        with self._lock:
            seq = self.scheduler.seqs.get(request_id)
            if seq is None:
                return
            if seq.state is PrefillState.SENDING:
                self._aborted.add(request_id)
            else:
                self.allocator.free(self.scheduler.release(request_id))

    def poll_events(self) -> list[PrefillFailure]:
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def stats(self) -> PrefillStats:
        with self._lock:
            seqs = list(self.scheduler.seqs.values())
            return PrefillStats(
                self.worker_id,
                sum(s.state is not PrefillState.SENDING for s in seqs),
                self.scheduler.queued_tokens,
                sum(s.state is PrefillState.SENDING for s in seqs),
                self.allocator.num_used,
                self.allocator.num_pages,
            )

    def step(self) -> bool:
        """Runs one forward pass over the next chunks; returns False when there was nothing to do. The forward
        runs without the worker's lock, so `submit` and `abort` never wait for it."""
        with self._lock:
            plan = self.scheduler.schedule()
            if not plan:
                return False
            chunks, samples = [], []
            for c in plan:
                r = c.seq.request
                chunks.append(
                    SeqChunk(r.token_ids[c.start : c.start + c.length], c.start, c.seq.pages)
                )
                samples.append(SampleSpec(r.params, r.num_generated) if c.is_last else None)
            self.allocator.hold_frees()
        try:
            tokens = self.runner.prefill(chunks, samples)
            error = None
        except Exception as e:  # fail this batch's requests, keep serving
            logger.error("prefill forward failed", exc_info=True)
            tokens, error = [None] * len(plan), e
        with self._lock:
            self.allocator.release_held()
            for c, token in zip(plan, tokens, strict=True):
                seq = c.seq
                if self.scheduler.seqs.get(seq.request.request_id) is not seq:
                    continue  # aborted while the forward ran
                if error is not None:
                    self._fail(seq.request.request_id, f"prefill failed: {error}")
                    continue
                self.scheduler.chunk_done(c)
                if c.is_last:
                    self._sends.submit(self._send, seq, token)
        return True

    def close(self) -> None:
        self._sends.shutdown(wait=True, cancel_futures=False)
        self.sender.close()

    def _fail(self, request_id: str, error: str) -> None:
        """Under the lock: forget the request, free its pages, report it."""
        self.allocator.free(self.scheduler.release(request_id))
        self._aborted.discard(request_id)
        self._failures.append(
            PrefillFailure(request_id, f"prefill worker {self.worker_id}: {error}")
        )

    def _send(self, seq: PrefillSeq, first_token: int) -> None:
        r = seq.request
        try:
            start = time.perf_counter()
            self.sender.send(
                r.decode_peer, r.transfer_id, self.runner.cache.data, list(seq.pages),
                len(r.token_ids), first_token, r.dest_cuts,
            )  # fmt: skip
            logger.debug(
                "sent %s: %d pages in %.1f ms", r.request_id, len(seq.pages),
                1e3 * (time.perf_counter() - start),
            )  # fmt: skip
            error = None
        except PdserveError as e:
            error = str(e)
        except Exception as e:  # thread boundary
            logger.error("send of %s failed", r.request_id, exc_info=True)
            error = f"KV send failed: {e}"
        with self._lock:
            if error is not None and r.request_id not in self._aborted:
                self._fail(r.request_id, error)
            else:
                self._aborted.discard(r.request_id)
                self.allocator.free(self.scheduler.release(r.request_id))
