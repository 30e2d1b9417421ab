"""The profiler ranges of a forward pass and their breakdown (`engine.step_profile`), on the CPU: a tiny model's
prefill under torch.profiler gives host time to each of its parts (one dense layer, one MoE layer, the logits),
the parts add up to no more than the whole, and outside a profiler the model runs as before."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.engine.step_profile import CATEGORIES, breakdown
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint


def test_a_prefill_breaks_down_by_part(tmp_path):
    path = make_checkpoint(tmp_path / "tiny", "tiny", dtype="fp32", progress=False)
    model = load_model(path, dtype=torch.float32, progress=False)
    layout = KVCacheLayout.for_model(model.args, 16, torch.float32, model.num_mtp)
    cache = PagedKVCache(layout, 8, "cpu")
    batch = build_forward_batch([SeqChunk(list(range(3, 40)), 0, [0, 1, 2])], 16, "cpu", False)
    with torch.inference_mode():
        plain = model.compute_logits(model(batch, cache)[batch.logits_indices])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            logits = model.compute_logits(model(batch, cache)[batch.logits_indices])
    assert torch.equal(logits, plain)
    parts = breakdown(prof, on_device=False)
    assert set(parts) == {*CATEGORIES, "total"}
    for part in ("attention", "dense MLP", "MoE experts", "MoE other", "logits"):
        assert parts[part] > 0, (part, parts)  # the tiny model: a dense layer, then a MoE layer
    assert parts["MoE exchange"] == 0  # one process: nothing to exchange
    assert sum(parts[c] for c in CATEGORIES) <= parts["total"] * 1.0001
