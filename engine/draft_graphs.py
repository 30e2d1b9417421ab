"""CUDA graphs for a decode step's MTP passes (`MTPDrafter.after_decode`): the pass over the verify rows, the
pick of each request's row, and the chain of draft passes with their heads and draws, captured once per (verify
bucket, requests bucket, drafts, sampled) and replayed, so that drafting costs a few launches instead of a few
hundred.

The first pass reads the verify graph's own buffers (`DecodeGraphs`): its final hidden states, positions, cache
slots, sequence lengths and page tables; only its input tokens (each row's successor) are copied in. The rows
each request goes on from are an index into them; the chain passes' positions, slots and page tables are
computed from it on the device (a padding row's chain writes only the scratch page). Greedy drafts are the
argmax; sampled ones race the draft stream's noise over the kept probabilities, the draws of `draft_tokens`,
with each request's sampling fields copied into static buffers."""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Sequence

import torch

from pdserve.engine.cuda_graphs import BATCH_BUCKETS, DecodeGraphs
from pdserve.engine.speculative import DRAFT_STREAM
from pdserve.engine.step import MAX_GRAPH_ROWS, SampleSpec
from pdserve.kernels.sampling.ref import sample_with_distribution
from pdserve.model.batch import ForwardBatch
from pdserve.model.deepseek import Transformer
from pdserve.model.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    next_ids: torch.Tensor  # [R] int64: each verify row's successor
    select: torch.Tensor  # [N] int64: the row each request goes on from
    pad: torch.Tensor  # [N] bool: padding requests
    temperature: torch.Tensor  # [N] fp32
    top_k: torch.Tensor  # [N] int32
    top_p: torch.Tensor  # [N] fp32
    min_p: torch.Tensor  # [N] fp32
    seeds: torch.Tensor  # [N] int64 (the draft stream's)
    steps: torch.Tensor  # [N] int64: the first draft's step
    drafts: torch.Tensor  # [K, N] int64, output: a view of `DraftGraphs`' shared buffer
    probs: torch.Tensor | None  # [K, N, V] fp32, output (sampled graphs), likewise


class DraftGraphs:
    def __init__(self, model: Transformer, cache: PagedKVCache, decode: DecodeGraphs, depth_module):
        """depth_module: the MTP module drafting at a depth (`MTPDrafter.depth_module`)."""
        self.model, self.cache, self.decode = model, cache, decode
        self.depth_module = depth_module
        self.page_size = cache.layout.page_size
        self.device = cache.device
        self._graphs: dict[tuple, _DraftGraph] = {}
        self._failed: set[tuple] = set()
        self._out: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        """Per draft count: the drafts [K, max rows] and draft distributions [K, max rows, V] every graph
        writes its outputs into (one buffer for all graphs: a graph's outputs are read before the next
        replays)."""
        self.enabled = True

    def run(
        self, key: tuple[int, int], num_rows: int, next_ids: Sequence[int], last: Sequence[int],
        specs: Sequence[SampleSpec], num_drafts: int,
    ) -> tuple[list[list[int]], torch.Tensor | None] | None:  # fmt: skip
        """The drafts [per request, num_drafts] and, where any request samples, their distributions
        [K, requests, V] (a view of the graph's buffer: copy what is kept), for the verify rows the decode
        graph of bucket `key` just ran (`num_rows` of them); None where no graph fits (run eagerly). With
        no drafts, the first pass alone runs."""
        if not self.enabled:
            return None
        n = len(last)
        i = bisect.bisect_left(BATCH_BUCKETS, n)
        if i == len(BATCH_BUCKETS) or BATCH_BUCKETS[i] > key[0]:
            return None
        sampled = any(s.temperature > 0 for s in specs)
        gkey = (key, BATCH_BUCKETS[i], num_drafts, sampled)
        graph = self._graphs.get(gkey)
        if graph is None:
            if gkey in self._failed:
                return None
            try:
                graph = self._capture(*gkey)
            except RuntimeError:
                logger.warning(
                    "draft graph capture %s failed: its drafts run eagerly", gkey, exc_info=True
                )
                self._failed.add(gkey)
                self.decode.capture_failed()
                return None
            self._graphs[gkey] = graph
        g = graph

        def fill(buf, values, pad_value):
            host = torch.tensor(list(values) + [pad_value] * (buf.shape[0] - len(values)),
                                dtype=buf.dtype)  # fmt: skip
            buf.copy_(host, non_blocking=True)

        fill(g.next_ids, next_ids, 0)
        pad_row = num_rows if num_rows < key[0] else 0
        fill(g.select, last, pad_row)
        fill(g.pad, [False] * n, True)
        if sampled:
            fill(g.temperature, [s.temperature for s in specs], 0.0)
            fill(g.top_k, [s.top_k for s in specs], -1)
            fill(g.top_p, [s.top_p for s in specs], 1.0)
            fill(g.min_p, [s.min_p for s in specs], 0.0)
            fill(g.seeds, [s.seed ^ DRAFT_STREAM for s in specs], 0)
            fill(g.steps, [s.step for s in specs], 0)
        g.graph.replay()
        if not num_drafts:
            return [[] for _ in range(n)], None
        drafts = g.drafts[:, :n].t().tolist()  # [n, K]
        return drafts, (None if g.probs is None else g.probs[:, :n])

    def _capture(self, key: tuple[int, int], bucket: int, num_drafts: int, sampled: bool):
        verify = self.decode._graph(key)
        if verify is None:
            raise RuntimeError(f"no decode graph for bucket {key}")
        s, rows = verify.batch, key[0]
        dev = self.device

        def zeros(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=dev)

        out_drafts, out_probs = self._outputs(num_drafts, sampled)
        g = _DraftGraph(
            torch.cuda.CUDAGraph(), zeros(rows, dtype=torch.int64), zeros(bucket, dtype=torch.int64),
            torch.ones(bucket, dtype=torch.bool, device=dev), zeros(bucket, dtype=torch.float32),
            torch.full((bucket,), -1, dtype=torch.int32, device=dev),
            torch.ones(bucket, dtype=torch.float32, device=dev), zeros(bucket, dtype=torch.float32),
            zeros(bucket, dtype=torch.int64), zeros(bucket, dtype=torch.int64),
            out_drafts[:, :bucket], None if not sampled else out_probs[:, :bucket],
        )  # fmt: skip
        scratch = self.decode.scratch_page
        ps = self.page_size
        first = dataclasses.replace(s, input_ids=g.next_ids)

        def body():
            h = self.model.mtp_forward(self.depth_module(0), verify.hidden, g.next_ids, first,
                                       self.cache)  # fmt: skip
            if not num_drafts:  # the pass alone: the module's cache layer at the rows' positions
                return
            x = h[g.select]  # [N, D]
            base = s.positions[g.select]  # [N]: the continue rows' positions
            table = torch.where(g.pad[:, None], scratch, s.page_table[g.select])  # [N, W]
            drafts, probs = [], []
            for depth in range(num_drafts):
                module = self.depth_module(depth)
                if depth:
                    pos = torch.where(g.pad, depth - 1, base + depth)
                    page = table.gather(1, (pos // ps)[:, None])[:, 0].long()
                    chain = ForwardBatch(
                        is_decode=True, input_ids=drafts[-1], positions=pos,
                        slot_mapping=page * ps + pos % ps,
                        cu_seqlens_q=torch.arange(bucket + 1, dtype=torch.int32, device=dev),
                        seq_lens=(pos + 1).to(torch.int32), page_table=table,
                        logits_indices=torch.arange(bucket, dtype=torch.int64, device=dev),
                        num_queries_per_seq=1,
                    )  # fmt: skip
                    x = self.model.mtp_forward(module, x, drafts[-1], chain, self.cache)
                logits = self.model.mtp_head(module, x)  # [N, V]
                if sampled:  # `draft_tokens`' draws
                    drawn, q = sample_with_distribution(
                        logits, g.temperature, g.top_k, g.top_p, g.min_p, g.seeds, g.steps + depth
                    )
                    drafts.append(drawn)
                    probs.append(q)
                else:
                    drafts.append(logits.argmax(-1))
            g.drafts.copy_(torch.stack(drafts))
            if probs:
                g.probs.copy_(torch.stack(probs))

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles and fills lazy caches outside the capture
                body()
            g.graph.capture_begin(self.decode._pool, capture_error_mode="thread_local")
            try:
                body()
            finally:
                g.graph.capture_end()
        torch.cuda.current_stream(dev).wait_stream(stream)
        logger.debug("captured draft graph %s", (key, bucket, num_drafts, sampled))
        return g

    def _outputs(self, num_drafts: int, sampled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        drafts, probs = self._out.get(num_drafts, (None, None))
        if drafts is None:
            drafts = torch.zeros(num_drafts, MAX_GRAPH_ROWS, dtype=torch.int64, device=self.device)
        if sampled and probs is None:
            vocab = self.model.args.vocab_size
            probs = torch.zeros(num_drafts, MAX_GRAPH_ROWS, vocab, device=self.device)
        self._out[num_drafts] = (drafts, probs)
        return drafts, probs

    def close(self) -> None:
        self.enabled = False
        self._graphs.clear()
