"""`DecodeWorker`: holds requests' KV pages, runs the continuous decode batch and streams tokens.

A plain class (Ray wraps it in pdserve.cluster). Control calls (`add_request`, `abort`, `stats`) may come from any
thread; `step` runs on the worker's loop thread and holds the worker's lock for the whole step, so a page is never
freed while a forward pass may still write it. KV pages arrive through a `KVReceiver` writing straight into the
cache; with no prefill peer the worker prefills the request itself (the aggregated path). Outputs of each step are
queued as one batch for `poll_outputs`.
"""

from __future__ import annotations

import logging
import queue
import time

from pdserve import kernels
from pdserve.engine.messages import DecodeRequest, DecodeStats, RequestOutput, Reservation
from pdserve.engine.worker import Worker
from pdserve.kvtransfer import ExpectedTransfer, KVReceiver, MakeReceiver
from pdserve.model.batch import SeqChunk
from pdserve.model.deepseek import Transformer
from pdserve.model.runner import SampleSpec

from .config import DecodeConfig
from .scheduler import DecodeScheduler, RequestState

logger = logging.getLogger(__name__)


class DecodeWorker(Worker):
    idle_wait_s = 0.005

    def __init__(
        self,
        worker_id: str,
        model: Transformer,
        config: DecodeConfig,
        make_receiver: MakeReceiver | None = None,
        kv_cache_dtype: str = "auto",
    ):
        """kv_cache_dtype: auto or fp8 (`pdserve.model.kv_cache`); must be the prefill workers'."""
        super().__init__(worker_id, model, config, kv_cache_dtype, cuda_graphs=config.cuda_graphs)
        args = model.args
        self.scheduler = DecodeScheduler(
            self.allocator, config.page_size, config.max_running, config.max_num_batched_tokens,
            config.max_prefill_chunk, args.vocab_size, args.max_position_embeddings, args.eos_token_ids,
            fixed_chunks=kernels.batch_invariant(),
        )  # fmt: skip
        self.receiver: KVReceiver | None = (
            make_receiver(self.runner.cache.data) if make_receiver else None
        )
        self._outputs: queue.SimpleQueue[list[RequestOutput]] = queue.SimpleQueue()

    def add_request(self, request: DecodeRequest) -> Reservation:
        """Admits a request, taking pages for its prompt (and tokens generated before a preemption). With a
        prefill peer the pages wait for that worker's transfer; without, this worker prefills them.
        Raises InvalidRequestError (never fits) or CapacityError (full right now)."""
        with self._lock:
            if request.prefill_peer is not None and self.receiver is None:
                raise ValueError(f"{self.worker_id} has no KV receiver: prefill_peer must be None")
            seq = self.scheduler.admit(request)
            if request.prefill_peer is not None:
                deadline = time.monotonic() + self.config.kv_wait_timeout_s
                cuts = self.receiver.expect(
                    ExpectedTransfer(
                        seq.transfer_id, request.prefill_peer, list(seq.pages), deadline
                    )
                )
            else:
                cuts = ()
        self._wake.set()
        return Reservation(seq.transfer_id, len(seq.pages), tuple(cuts))

    def abort(self, request_id: str) -> None:
        """Cancels a request and frees its pages; its last output says finish_reason=abort."""
        with self._lock:
            seq = self.scheduler.seqs.get(request_id)
            if seq is None:
                return
            if seq.state is RequestState.WAITING_FOR_KV:
                self.receiver.cancel(seq.transfer_id)  # no page write after this returns
            outputs = self.scheduler.abort(request_id)
        self._emit(outputs)

    def poll_outputs(self, timeout_s: float = 0.0) -> list[RequestOutput]:
        """Outputs since the last call, oldest first; waits up to timeout_s for the first batch."""
        out: list[RequestOutput] = []
        try:
            out.extend(
                self._outputs.get(timeout=timeout_s)
                if timeout_s > 0
                else self._outputs.get_nowait()
            )
        except queue.Empty:
            return out
        while True:
            try:
                out.extend(self._outputs.get_nowait())
            except queue.Empty:
                return out

    def stats(self) -> DecodeStats:
        with self._lock:
            seqs = list(self.scheduler.seqs.values())
            return DecodeStats(
                self.worker_id,
                sum(s.state is RequestState.RUNNING for s in seqs),
                sum(s.state is not RequestState.RUNNING for s in seqs),
                self.allocator.num_used,
                self.allocator.num_pages,
                self.config.max_running,
                self.config.page_size,
                self.scheduler.num_preemptions,
            )

    def can_admit(self, num_tokens: int) -> bool:
        with self._lock:
            return self.scheduler.can_admit(num_tokens)

    def step(self) -> bool:
        """Takes arrived KV, then runs one local-prefill pass and one decode pass. False when idle. Forward passes
        run without the worker's lock (control calls never wait for them); pages freed meanwhile are held back
        until the passes end, since they may still be written."""
        with self._lock:
            outputs: list[RequestOutput] = []
            if self.receiver is not None:
                for r in self.receiver.poll():
                    if r.error is None:
                        outputs += self.scheduler.kv_arrived(
                            r.transfer_id, r.num_tokens, r.first_token
                        )
                    else:
                        outputs += self.scheduler.kv_failed(r.transfer_id, r.error)
            plan = self.scheduler.schedule()
            outputs += plan.outputs
            prefill_work = self._prepare_prefill(plan.prefill) if plan.prefill else None
            decode_work = self._prepare_decode(plan.decode) if plan.decode else None
            if prefill_work or decode_work:
                self.allocator.hold_frees()
        prefill_result = self._forward(self.runner.prefill, prefill_work, "local prefill")
        decode_result = self._forward(self.runner.decode, decode_work, "decode")
        if prefill_work or decode_work:
            with self._lock:
                self.allocator.release_held()
                if prefill_work:
                    outputs += self._finish_prefill(plan.prefill, prefill_result)
                if decode_work:
                    outputs += self._finish_decode(plan.decode, decode_result)
        self._emit(outputs)
        return bool(plan.prefill or plan.decode or outputs)

    @staticmethod
    def _forward(run, work, what: str):
        """(tokens, None) or (None, error) for one pass; None when there is no work."""
        if work is None:
            return None
        try:
            return run(*work), None
        except Exception as e:  # fail these requests, keep serving
            logger.error("%s failed", what, exc_info=True)
            return None, e

    def _prepare_prefill(self, chunks):
        specs = []
        for seq, start, length in chunks:
            last = start + length == len(seq.token_ids)
            specs.append(SampleSpec(seq.request.params, seq.num_generated) if last else None)
        seq_chunks = [SeqChunk(s.token_ids[a : a + n], a, list(s.pages)) for s, a, n in chunks]
        return seq_chunks, specs

    def _finish_prefill(self, chunks, result):
        tokens, error = result
        if error is not None:
            return [o for s, _, _ in chunks for o in self.scheduler.abort(s.request_id, str(error))]
        outputs = []
        for (seq, start, length), token in zip(chunks, tokens, strict=True):
            outputs += self.scheduler.prefill_done(seq, start, length, token)
        return outputs

    def _prepare_decode(self, seqs):
        chunks = [SeqChunk(s.token_ids[-1:], len(s.token_ids) - 1, list(s.pages)) for s in seqs]
        specs = [SampleSpec(s.request.params, s.num_generated) for s in seqs]
        return chunks, specs

    def _finish_decode(self, seqs, result):
        tokens, error = result
        if error is not None:
            return [
                o
                for s in seqs
                for o in self.scheduler.abort(s.request_id, f"decode failed: {error}")
            ]
        return self.scheduler.decode_done(seqs, tokens)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._outputs.put(outputs)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
