"""A step's time by part (`engine.step_profile`). On the CPU, a tiny model's prefill, logits and sampling under
torch.profiler: each part gets the host time of its range less the ranges nested in it, and the parts sum to
the top-level events' time. The device path's linking, over the profiler's own event classes built by hand
(no GPU): each kernel, memcpy and memset counts once, in the innermost range around its launch, and the ranges'
device spans, syncs and runtime calls count nowhere. On a GPU, the same over a real profile."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent
from torch.profiler import ProfilerActivity, profile

from pdserve.engine.sampler import SPAN_SAMPLING, sample
from pdserve.engine.step import SampleSpec
from pdserve.engine.step_profile import (
    CATEGORIES,
    DEVICE_WORK,
    Record,
    attribute,
    breakdown,
    records,
)
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.deepseek import SPAN_ATTENTION, SPAN_EXCHANGE, SPAN_EXPERTS, SPAN_MOE
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint

KEYS = {*CATEGORIES, "total", "busy", "unlinked"}


def _profiled_prefill(model, device: str, activities):
    """The model's prefill of one 37-token sequence, its logits and a greedy sample, under the profiler."""
    layout = KVCacheLayout.for_model(model.args, 16, model.dtype, model.num_mtp)
    cache = PagedKVCache(layout, 8, device)
    batch = build_forward_batch([SeqChunk(list(range(3, 40)), 0, [0, 1, 2])], 16, device, False)
    spec = SampleSpec(0.0, 1.0, -1, 0.0, 0, 0)
    with torch.inference_mode():
        plain = model.compute_logits(model(batch, cache)[batch.logits_indices])
        with profile(activities=activities) as prof:
            logits = model.compute_logits(model(batch, cache)[batch.logits_indices])
            tokens, _ = sample(logits, [spec])
    assert tokens == logits.argmax(-1).tolist()
    return prof, torch.equal(logits, plain)


def _span_total_s(prof, name: str) -> float:
    return sum(e.cpu_time_total for e in prof.events() if e.name == name) / 1e6


def test_a_prefill_breaks_down_by_part_on_the_host(model_dir):
    model = load_model(model_dir, dtype=torch.float32, progress=False)
    prof, same = _profiled_prefill(model, "cpu", [ProfilerActivity.CPU])
    assert same  # the ranges change nothing
    parts = breakdown(prof, on_device=False)
    assert set(parts) == KEYS
    for part in ("attention", "dense MLP", "MoE experts", "MoE other", "logits", "sampling"):
        assert parts[part] > 0, (part, parts)  # the tiny model: a dense layer, then a MoE layer
    assert parts["MoE exchange"] == 0  # one process: nothing to exchange
    assert parts["busy"] == parts["unlinked"] == 0
    # the torch profiler's own totals: nothing nests in attention or sampling; the MoE holds the experts
    assert math.isclose(parts["attention"], _span_total_s(prof, SPAN_ATTENTION), rel_tol=1e-9)
    assert math.isclose(parts["sampling"], _span_total_s(prof, SPAN_SAMPLING), rel_tol=1e-9)
    moe_rest = _span_total_s(prof, SPAN_MOE) - _span_total_s(prof, SPAN_EXPERTS)
    assert math.isclose(parts["MoE other"], moe_rest, rel_tol=1e-6)
    top = [e for e in prof.events() if e.cpu_parent is None and not e.is_async]
    assert math.isclose(parts["total"], sum(e.cpu_time_total for e in top) / 1e6, rel_tol=1e-9)
    assert math.isclose(parts["total"], sum(parts[c] for c in CATEGORIES), rel_tol=1e-12)


def _event(id, name, start, end, linked=0, kind="cpu_op"):  # noqa: A002 (the profiler's name)
    device = kind in DEVICE_WORK or kind in ("gpu_user_annotation", "cuda_sync")
    return FunctionEvent(
        id=id, name=name, thread=1, start_us=start, end_us=end, use_device="cuda",
        device_type=DeviceType.CUDA if device else DeviceType.CPU, activity_type=kind,
        is_user_annotation=kind in ("user_annotation", "gpu_user_annotation"),
        linked_correlation_id=linked, stack=[], input_shapes=[],
    )  # fmt: skip


def _moe_step_events() -> EventList:
    """A MoE layer and its surroundings as the profiler gives them on a GPU (host microseconds 0-150, device
    200-433): ops and ranges with correlation ids, runtime calls carrying the op's id as their link, kernels
    carrying the runtime call's id and the op's link."""
    ann, rt = "user_annotation", "cuda_runtime"
    evts = [
        _event(1, SPAN_MOE, 0, 100, kind=ann),
        _event(2, "aten::mm", 5, 10),  # the gate
        _event(1001, "cudaLaunchKernel", 6, 8, 2, rt),
        _event(3, SPAN_EXCHANGE, 10, 40, kind=ann),
        _event(4, "c10d::allgather_", 12, 30),
        _event(1002, "cudaLaunchKernel", 14, 16, 4, rt),
        _event(1007, "cudaLaunchKernel", 20, 22, 4, rt),
        _event(5, SPAN_EXPERTS, 40, 80, kind=ann),
        _event(1003, "cudaLaunchKernel", 45, 47, 5, rt),  # a Triton kernel: no op, the range's link
        _event(6, "pdserve::fused", 82, 95),
        _event(7, "pdserve::fused", 83, 94),  # dropped by the tree: its parent has its name
        _event(1004, "cudaLaunchKernel", 84, 86, 7, rt),
        _event(8, "aten::copy_", 110, 120),
        _event(1005, "cudaMemcpyAsync", 111, 113, 8, rt),
        _event(9, SPAN_ATTENTION, 130, 150, kind=ann),
        _event(1006, "cudaLaunchKernel", 131, 132, 9, rt),
        # the device
        _event(1001, "gate_gemm", 200, 210, 2, "kernel"),
        _event(1, SPAN_MOE, 200, 380, 0, "gpu_user_annotation"),
        _event(3, SPAN_EXCHANGE, 215, 315, 0, "gpu_user_annotation"),
        _event(1002, "ncclAllGather", 215, 315, 4, "kernel"),  # mostly waiting for the other rank
        _event(1007, "side_stream", 250, 260, 4, "kernel"),  # overlaps it on another stream
        _event(1003, "fused_moe", 320, 370, 5, "kernel"),
        _event(1004, "fused_add", 370, 380, 7, "kernel"),
        _event(3000, "cudaStreamSynchronize", 380, 400, 0, "cuda_sync"),
        _event(1005, "Memcpy HtoD", 400, 405, 8, "gpu_memcpy"),
        _event(9, SPAN_ATTENTION, 410, 430, 0, "gpu_user_annotation"),
        _event(1006, "mla_decode", 410, 430, 9, "kernel"),
        _event(2000, "unknown_kernel", 430, 433, 0, "kernel"),  # its launch not recorded
    ]
    ops = {
        e.id: e for e in evts if e.device_type == DeviceType.CPU and e.linked_correlation_id == 0
    }
    for e in evts:  # as the profiler's parse gives an op its kernels, before it builds the tree
        if e.activity_type in DEVICE_WORK and e.linked_correlation_id in ops:
            ops[e.linked_correlation_id].append_kernel(e.name, 0, e.time_range.elapsed_us())
    events = EventList(evts, use_device="cuda")
    events._build_tree()
    assert "pdserve::fused" in [e.name for e in events] and 7 not in [e.id for e in events]
    return events


def test_device_work_counts_once_in_the_innermost_range_of_its_launch():
    recs = records(_moe_step_events())
    parts = attribute(recs, on_device=True)
    assert set(parts) == KEYS
    want = {"attention": 20, "MoE exchange": 110, "MoE experts": 50, "MoE other": 20, "other": 8}
    for c in CATEGORIES:
        assert math.isclose(parts[c], want.get(c, 0) / 1e6, abs_tol=1e-12), (c, parts)
    assert math.isclose(parts["total"], 208e-6, abs_tol=1e-12)
    assert math.isclose(parts["busy"], 198e-6, abs_tol=1e-12)  # the overlapped 10 us once
    assert math.isclose(parts["unlinked"], 3e-6, abs_tol=1e-12)
    assert sum(r.device for r in recs) == 8  # no range span, no sync


def test_key_averages_counts_kernels_twice_and_the_ranges_device_spans():
    """Why `breakdown` does not sum `key_averages`: a range has two rows there, its host event and its device
    span (first kernel to last, gaps included), and each kernel has a row beside its op's."""
    rows = _moe_step_events().key_averages()
    assert [r.device_type for r in rows if r.key == SPAN_MOE] == [DeviceType.CPU, DeviceType.CUDA]
    everything = sum(r.self_device_time_total for r in rows)
    assert (
        everything == 205 + 528
    )  # the ops' kernels, then every device row: 733 us for 208 of work


def test_host_time_of_the_same_events_is_self_time_by_range():
    parts = breakdown(type("P", (), {"events": staticmethod(_moe_step_events)})(), on_device=False)
    assert math.isclose(
        parts["total"], (100 + 10 + 20) / 1e6, abs_tol=1e-12
    )  # the top-level events
    assert math.isclose(parts["MoE exchange"], 30e-6, abs_tol=1e-12)
    assert math.isclose(parts["MoE experts"], 40e-6, abs_tol=1e-12)
    assert math.isclose(parts["MoE other"], 30e-6, abs_tol=1e-12)
    assert math.isclose(parts["other"], 10e-6, abs_tol=1e-12)


@pytest.mark.parametrize(
    "recs, message",
    [
        ([Record("a", 0, 1, 3, False)], "parent 3 is not another of 1 records"),
        ([Record("a", 0, 1, 0, False)], "parent 0 is not another"),
        ([Record("k", 0, 1, None, True), Record("a", 0, 1, 0, False)], "parent 0 is device work"),
        ([Record("a", 0, 1, 1, False), Record("b", 0, 1, 0, False)], "its parents loop"),
        ([Record("a", 2, 1, None, False)], "ends at 1 us before it starts at 2"),
    ],
)
def test_bad_records_are_refused(recs, message):
    with pytest.raises(ValueError, match=message):
        attribute(recs, on_device=False)


@pytest.mark.gpu
def test_a_prefill_breaks_down_by_part_on_the_gpu(tmp_path):
    path = make_checkpoint(tmp_path / "tiny", "tiny", dtype="bf16", progress=False)
    model = load_model(path, "cuda", torch.bfloat16, progress=False)
    prof, _ = _profiled_prefill(model, "cuda", [ProfilerActivity.CPU, ProfilerActivity.CUDA])
    parts = breakdown(prof, on_device=True)
    for part in ("attention", "dense MLP", "MoE experts", "MoE other", "logits", "sampling"):
        assert parts[part] > 0, (part, parts)
    spans = {SPAN_ATTENTION: "attention", SPAN_EXPERTS: "MoE experts", SPAN_SAMPLING: "sampling"}
    device_spans = [e for e in prof.events() if e.activity_type == "gpu_user_annotation"]
    # a range's kernels fit in its device span (its first kernel's start to its last one's end)
    for span, part in spans.items():
        span_us = sum(e.time_range.elapsed_us() for e in device_spans if e.name == span)
        assert parts[part] <= span_us / 1e6 * (1 + 1e-9), (part, parts[part], span_us)
    work = [e for e in prof.events() if e.activity_type in DEVICE_WORK]
    kernel_s = sum(e.time_range.elapsed_us() for e in work) / 1e6
    assert math.isclose(parts["total"], kernel_s, rel_tol=1e-9)
    assert parts["busy"] <= parts["total"] * (1 + 1e-9)
