# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""Kernels of a CUDA-graph replay of the decode forward (torch.profiler sees graph kernels), per kernel, us.
usage: prof_graph.py CKPT B"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model

path, B = sys.argv[1], int(sys.argv[2])
context, page = 1024, 64
model = load_model(path, "cuda", torch.bfloat16, progress=False)
per = -(-(context + 2) // page)
layout = KVCacheLayout.for_model(model.args, page, model.dtype, model.num_mtp)
cache = PagedKVCache(layout, B * per, "cuda")
cache.data.normal_()
toks = torch.randint(
    3, model.args.vocab_size, (B,), generator=torch.Generator().manual_seed(B)
).tolist()
chunks = [SeqChunk([t], context, list(range(b * per, (b + 1) * per))) for b, t in enumerate(toks)]
batch = build_forward_batch(chunks, page, "cuda", True)
s = torch.cuda.Stream()
with torch.cuda.stream(s), torch.inference_mode():
    for _ in range(2):
        model(batch, cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        model(batch, cache)
torch.cuda.synchronize()
for _ in range(5):
    graph.replay()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
evs = sorted(
    [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA],
    key=lambda e: e.time_range.start,
)
n = len(evs) // 10
one = evs[:n]
t0 = one[0].time_range.start
print(
    f"B={B}: {n} kernels a forward; span {one[-1].time_range.end - t0:.1f} us; sum of durations {sum(e.device_time for e in one):.1f} us"
)
prev_end = t0
for e in one:
    gap = e.time_range.start - prev_end
    print(f"{e.time_range.start - t0:8.1f} {e.device_time:7.1f} gap {gap:6.1f}  {e.name[:70]}")
    prev_end = e.time_range.end
