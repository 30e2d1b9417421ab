"""CUDA graphs for the decode step: the forward from token ids to logits, captured once per (batch bucket,
page-table bucket) and replayed, so a step costs one graph launch instead of hundreds of kernel launches from
Python.

A replay reads static input buffers: the step's tokens, positions, cache slots, sequence lengths and page tables
are copied into them first. Batches smaller than their bucket are padded with rows that read and write only a
scratch page that the worker's allocator never hands out; their logits are dropped. Shapes beyond the largest
bucket run eagerly.

Capture uses the thread-local capture mode: the decode worker's KV-receiver threads keep polling NCCL while a
graph is captured, and the default (global) mode invalidates a capture whenever another thread makes such a
CUDA call. If a capture fails anyway, that bucket's steps run eagerly (with a warning); no request fails for
it.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging

import torch

from pdserve.engine.step import MAX_GRAPH_ROWS
from pdserve.model.batch import ForwardBatch
from pdserve.model.deepseek import Transformer
from pdserve.model.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, MAX_GRAPH_ROWS)


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch
    hidden: torch.Tensor  # [bucket, D], the graph's final-norm hidden states (MTP reads them)
    logits: torch.Tensor  # [bucket, V] fp32, the graph's output buffer


class DecodeGraphs:
    def __init__(
        self, model: Transformer, cache: PagedKVCache, scratch_page: int, max_batch: int = 256
    ):
        """`scratch_page`: a page id of `cache` no request ever owns (padding rows write there)."""
        self.model, self.cache, self.scratch_page = model, cache, scratch_page
        self.page_size = cache.layout.page_size
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b <= max_batch)
        self.device = cache.device
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.enabled = True
        self._failed: set[tuple[int, int]] = set()
        self.last_key: tuple[int, int] | None = None
        """The bucket the last `forward` replayed (None: it ran eagerly)."""

    def bucket(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The (batch, pages) bucket of a decode batch of one query token per request, or None (run eagerly)."""
        if not batch.is_decode or batch.num_queries_per_seq != 1:
            return None
        return self.key(batch.num_seqs, batch.page_table.shape[1])

    def key(self, num_seqs: int, num_pages: int) -> tuple[int, int] | None:
        """The (batch, pages) bucket of `num_seqs` rows whose page tables are `num_pages` wide, or None."""
        i = bisect.bisect_left(self.batch_buckets, num_seqs)
        if i == len(self.batch_buckets):
            return None
        return self.batch_buckets[i], max(16, 1 << (max(num_pages, 1) - 1).bit_length())

    @torch.inference_mode()
    def logits(self, batch: ForwardBatch, key: tuple[int, int] | None = None) -> torch.Tensor:
        """Decode logits [B, V] fp32 for `batch`, through a graph when one fits. key: the bucket to run it in
        (at least `bucket(batch)`; the ranks of a worker run a step in a bucket they share)."""
        return self.forward(batch, key)[1]

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, key: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits`, with the final-norm hidden states [B, D] they came from (views of the graph's buffers:
        read them before the next replay)."""
        key = (key or self.bucket(batch)) if self.enabled else None
        graph = None if key is None else self._graph(key)
        self.last_key = None if graph is None else key
        if graph is None:
            hidden = self.model(batch, self.cache)
            return hidden, self.model.compute_logits(hidden)
        b, width = batch.num_seqs, batch.page_table.shape[1]
        s = graph.batch
        s.input_ids[:b].copy_(batch.input_ids)
        s.positions[:b].copy_(batch.positions)
        s.slot_mapping[:b].copy_(batch.slot_mapping)
        s.seq_lens[:b].copy_(batch.seq_lens)
        s.page_table[:b, :width].copy_(batch.page_table)
        self._pad(s, b)
        graph.graph.replay()
        return graph.hidden[:b], graph.logits[:b]

    @torch.inference_mode()
    def idle(self, key: tuple[int, int]) -> bool:
        """Replays bucket `key`'s graph with padding rows only: a rank with no rows of a step its worker's other
        ranks run in that bucket joins their collectives so. False (nothing run) when graphs are off."""
        graph = self._graph(key) if self.enabled else None
        if graph is None:
            return False
        self._pad(graph.batch, 0)
        graph.graph.replay()
        return True

    def close(self) -> None:
        """Destroys the captured graphs (before the process groups whose collectives they hold are destroyed:
        NCCL cannot tear down a communicator a live graph still launches on)."""
        self.enabled = False
        self._graphs.clear()
        torch.cuda.synchronize(self.device)

    def _graph(self, key: tuple[int, int]) -> _Graph | None:
        """Bucket `key`'s graph, captured now if need be; None when its capture failed (that bucket's steps
        then run eagerly; the other buckets keep their graphs)."""
        graph = self._graphs.get(key)
        if graph is None and key not in self._failed:
            try:
                graph = self._capture(*key)
            except RuntimeError:
                logger.warning(
                    "CUDA graph capture of bucket %s failed: its decode steps run eagerly", key,
                    exc_info=True,
                )  # fmt: skip
                self._failed.add(key)
                self.capture_failed()
        return graph

    def capture_failed(self) -> None:
        """After a failed capture (this class's or a drafter's over the same pool): later captures record
        into a new memory pool, since a capture that failed leaves its pool marked as recording."""
        torch.cuda.current_stream(self.device).synchronize()
        self._pool = torch.cuda.graph_pool_handle()

    def _pad(self, s: ForwardBatch, start: int) -> None:
        """Rows from `start` on attend to and write only the scratch page's first slot."""
        s.input_ids[start:] = 0
        s.positions[start:] = 0
        s.slot_mapping[start:] = self.scratch_page * self.page_size
        s.seq_lens[start:] = 1
        s.page_table[start:] = self.scratch_page

    def _capture(self, bucket: int, pages: int) -> _Graph:
        def zeros(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=self.device)

        static = ForwardBatch(
            is_decode=True,
            input_ids=zeros(bucket, dtype=torch.int64),
            positions=zeros(bucket, dtype=torch.int64),
            slot_mapping=zeros(bucket, dtype=torch.int64),
            cu_seqlens_q=torch.arange(bucket + 1, dtype=torch.int32, device=self.device),
            seq_lens=zeros(bucket, dtype=torch.int32),
            page_table=zeros(bucket, pages, dtype=torch.int32),
            logits_indices=torch.arange(bucket, dtype=torch.int64, device=self.device),
            num_queries_per_seq=1,
        )
        self._pad(static, 0)
        # Warm up on a side stream (compiles Triton kernels, fills lazy caches), then capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model.compute_logits(self.model(static, self.cache))
        # Capture on the same stream. Not through torch.cuda.graph(): it first synchronizes the whole device,
        # which would also wait for the KV receiver's posted NCCL receives (a transfer may be seconds away).
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(self._pool, capture_error_mode="thread_local")
            try:
                hidden = self.model(static, self.cache)
                logits = self.model.compute_logits(hidden)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        logger.debug("captured decode graph for batch %d x %d pages", bucket, pages)
        captured = _Graph(graph, static, hidden, logits)
        self._graphs[(bucket, pages)] = captured
        return captured
