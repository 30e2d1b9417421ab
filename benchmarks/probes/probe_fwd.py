# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""Device time of the model's decode forward (no batch building, no sampling): model(batch, cache) captured in
a CUDA graph for B requests at `context` cached tokens, median of 30 replays, with L2 not flushed.
usage: probe_fwd.py CKPT B[,B...] [context] [page]"""

import sys

import torch

from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model

path, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
context = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
page = int(sys.argv[4]) if len(sys.argv) > 4 else 64
model = load_model(path, "cuda", torch.bfloat16, progress=False)
for B in batches:
    per = -(-(context + 2) // page)
    layout = KVCacheLayout.for_model(model.args, page, model.dtype, model.num_mtp)
    cache = PagedKVCache(layout, B * per, "cuda")
    cache.data.normal_()
    g = torch.Generator().manual_seed(B)
    toks = torch.randint(3, model.args.vocab_size, (B,), generator=g).tolist()
    chunks = [
        SeqChunk([t], context, list(range(b * per, (b + 1) * per))) for b, t in enumerate(toks)
    ]
    batch = build_forward_batch(chunks, page, "cuda", True)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(2):
            model(batch, cache)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            out = model(batch, cache)
    torch.cuda.synchronize()
    ts = []
    for _ in range(40):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    ts = sorted(ts[10:])
    print(f"B={B:4d} forward {ts[len(ts) // 2]:8.1f} us (min {ts[0]:.1f})", flush=True)
    del graph, cache
    torch.cuda.empty_cache()
