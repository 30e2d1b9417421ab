# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""Prefill forward (eager) of a checkpoint at 1 x 4096, 4 x 1024 and 1 x 8192 tokens: median of 5 after 2
warm-ups, CUDA events, ms. usage: probe_prefill.py CKPT"""

import sys

import torch

from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model

model = load_model(sys.argv[1], "cuda", torch.bfloat16, progress=False)
page = 64
for nseq, length in ((1, 4096), (4, 1024), (1, 8192)):
    per = -(-length // page)
    layout = KVCacheLayout.for_model(model.args, page, model.dtype, model.num_mtp)
    cache = PagedKVCache(layout, nseq * per, "cuda")
    g = torch.Generator().manual_seed(length)
    chunks = [
        SeqChunk(
            torch.randint(3, 1000, (length,), generator=g).tolist(),
            0,
            list(range(b * per, (b + 1) * per)),
        )
        for b in range(nseq)
    ]
    batch = build_forward_batch(chunks, page, "cuda", False)
    ts = []
    with torch.inference_mode():
        for i in range(7):
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record()
            model(batch, cache)
            b.record()
            b.synchronize()
            if i >= 2:
                ts.append(a.elapsed_time(b))
    print(f"{nseq} x {length}: {sorted(ts)[2]:.3f} ms", flush=True)
    del cache
    torch.cuda.empty_cache()
