# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""Device time of the model's decode forward (no batch building, no sampling): model(batch, cache) captured in
a CUDA graph for B requests at `context` cached tokens, median of 30 replays, with L2 not flushed.
usage: probe_fwd.py CKPT B[,B...] [context] [page]"""

import sys

import torch
from _common import capture_forward, decode_batch, replay_us

from pdserve.model.loader import load_model

path, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
context = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
page = int(sys.argv[4]) if len(sys.argv) > 4 else 64
model = load_model(path, "cuda", torch.bfloat16, progress=False)
for B in batches:
    batch, cache = decode_batch(model, B, context, page)
    graph = capture_forward(model, batch, cache)
    ts = replay_us(graph.replay, 40, skip=10)
    print(f"B={B:4d} forward {ts[len(ts) // 2]:8.1f} us (min {ts[0]:.1f})", flush=True)
    del graph, cache
    torch.cuda.empty_cache()
