# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""Kernel device times of one eager decode forward, torch.profiler over 5 forwards, per kernel, us.
usage: prof_fwd.py CKPT B[,B...]"""

import sys

import torch
from _common import decode_batch
from torch.profiler import ProfilerActivity, profile

from pdserve.model.loader import load_model

path, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
context, page = 1024, 64
model = load_model(path, "cuda", torch.bfloat16, progress=False)
for B in batches:
    batch, cache = decode_batch(model, B, context, page)
    with torch.inference_mode():
        for _ in range(3):
            model(batch, cache)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                model(batch, cache)
            torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = e.name[:90]
            n, t = rows.get(k, (0, 0.0))
            rows[k] = (n + 1, t + e.device_time)
    total = sum(t for _, t in rows.values()) / 5
    print(f"== B={B}: kernel time per forward {total:.1f} us")
    for k, (n, t) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:28]:
        print(f"{t / 5:8.1f} us  x{n // 5:2d}  {k}")
    del cache
