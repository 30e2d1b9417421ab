# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""Kernels of a CUDA-graph replay of the decode forward (torch.profiler sees graph kernels), per kernel, us.
usage: prof_graph.py CKPT B"""

import sys

import torch
from _common import capture_forward, decode_batch
from torch.profiler import ProfilerActivity, profile

from pdserve.model.loader import load_model

path, B = sys.argv[1], int(sys.argv[2])
context, page = 1024, 64
model = load_model(path, "cuda", torch.bfloat16, progress=False)
batch, cache = decode_batch(model, B, context, page)
graph = capture_forward(model, batch, cache)
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
