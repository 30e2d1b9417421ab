"""What the probes share: a CUDA-graph timer, and a decode batch over a filled paged cache. Probes run as
scripts from the repository root (`python3 benchmarks/probes/NAME.py`), so this folder is on sys.path."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache


def replay_us(replay: Callable[[], object], replays: int, skip: int = 0) -> list[float]:
    """Each of `replays` calls of `replay` (a graph's), us, timed by CUDA events, sorted, the first
    `skip` (warm-up) dropped."""
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return sorted(ts[skip:])


def graph_us(fn: Callable[[], object], reps: int = 20, replays: int = 15) -> float:
    """Per call, us: fn captured `reps` times in one CUDA graph, median of `replays` replays."""
    fn()
    torch.cuda.synchronize()
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    ts = replay_us(g.replay, replays)
    return ts[len(ts) // 2] / reps


def decode_batch(model, batch_size: int, context: int, page: int):
    """(batch, cache): one new token for each of batch_size requests with `context` cached tokens each,
    over a cache of random values (seeded tokens, so every probe sees the same batch)."""
    per = -(-(context + 2) // page)
    layout = KVCacheLayout.for_model(model.args, page, model.dtype, model.num_mtp)
    cache = PagedKVCache(layout, batch_size * per, "cuda")
    cache.data.normal_()
    g = torch.Generator().manual_seed(batch_size)
    toks = torch.randint(3, model.args.vocab_size, (batch_size,), generator=g).tolist()
    chunks = [
        SeqChunk([t], context, list(range(b * per, (b + 1) * per))) for b, t in enumerate(toks)
    ]
    return build_forward_batch(chunks, page, "cuda", True), cache


def capture_forward(model, batch, cache) -> torch.cuda.CUDAGraph:
    """model(batch, cache) captured in a CUDA graph on a side stream, after two warm-up forwards."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(2):
            model(batch, cache)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            model(batch, cache)
    torch.cuda.synchronize()
    return graph
