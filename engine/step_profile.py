"""Where a step's time goes, by the profiler ranges of the model (`pdserve.model.deepseek.SPAN_*`) and of the
sampler (`pdserve.engine.sampler.SPAN_SAMPLING`): attention, dense MLP, the MoE's exchange (dispatch and combine,
waits for the other ranks included), its experts and the rest of it (gate, shared experts, quantization), the
logits, sampling, and everything else (norms, embedding, residual adds, the step's input copies).

`breakdown` reads a finished `torch.profiler.profile`. On the device it counts each kernel, memcpy and memset
once, by its duration, in the innermost range around the host call that launched it; the ranges' own device
events (`gpu_user_annotation`: the wall span from a range's first kernel to its last, idle gaps included) and
the host's runtime calls are not work and count nowhere. On the host it counts each event's self time (its
duration less its children's) in the innermost range around it. Either way the parts sum to "total": no time
is counted twice, and a range nested in another (the exchange and experts in the MoE) leaves the outer one
only what is outside it.

`attribute` does the counting over plain `Record`s (name, start, end, parent), so the device path's logic runs
without a GPU; `records` makes them from the profiler's events."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from torch.autograd import DeviceType

from pdserve.engine.sampler import SPAN_SAMPLING
from pdserve.model.deepseek import (
    SPAN_ATTENTION,
    SPAN_EXCHANGE,
    SPAN_EXPERTS,
    SPAN_LOGITS,
    SPAN_MLP,
    SPAN_MOE,
)

__all__ = ["CATEGORIES", "DEVICE_WORK", "Record", "attribute", "breakdown", "records"]

CATEGORIES = (
    "attention",
    "dense MLP",
    "MoE exchange",
    "MoE experts",
    "MoE other",
    "logits",
    "sampling",
    "other",
)

_PART_OF_SPAN = {
    SPAN_ATTENTION: "attention",
    SPAN_MLP: "dense MLP",
    SPAN_EXCHANGE: "MoE exchange",
    SPAN_EXPERTS: "MoE experts",
    SPAN_MOE: "MoE other",  # what of the MoE is in neither of the two ranges above, nested in it
    SPAN_LOGITS: "logits",
    SPAN_SAMPLING: "sampling",
}

DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""The profiler's activity types of a device event that is work; not `gpu_user_annotation` (a range's span)
nor `cuda_sync` (a wait)."""


class Record(NamedTuple):
    """One profiler event. parent: the index (in the same sequence) of the host event around a host event, or of
    the host event that launched a device event; None where there is none (a top-level host event, device work
    launched outside any op or range or whose launch was not recorded)."""

    name: str
    start_us: float
    end_us: float
    parent: int | None
    device: bool
    """A kernel, memcpy or memset on the device (else a host event)."""


def attribute(recs: Sequence[Record], on_device: bool) -> dict[str, float]:
    """Seconds per category (`CATEGORIES`), their sum "total", and:
    on the device, "busy": the seconds in which any device work ran (below "total" where streams overlap), and
    "unlinked": the seconds of device work with no launching host event (counted in "other"): launched
    outside any op or range (a Triton kernel between the ranges), or its launch not recorded;
    on the host, both 0.0. Raises ValueError on a record that ends before it starts, whose parent is not
    another host record of `recs`, or whose parents loop."""
    n = len(recs)
    for i, r in enumerate(recs):
        if r.end_us < r.start_us:
            raise ValueError(
                f"record {i} ({r.name!r}) ends at {r.end_us} us before it starts at {r.start_us}"
            )
        if r.parent is not None:
            if not 0 <= r.parent < n or r.parent == i:
                raise ValueError(
                    f"record {i} ({r.name!r}): parent {r.parent} is not another of {n} records"
                )
            if recs[r.parent].device:
                raise ValueError(
                    f"record {i} ({r.name!r}): parent {r.parent} is device work, not a host event"
                )
    parts: dict[int | None, str] = {None: "other"}

    def part_of(i: int | None) -> str:
        chain = []
        while i not in parts:
            if len(chain) > n:
                raise ValueError(f"record {chain[0]} ({recs[chain[0]].name!r}): its parents loop")
            chain.append(i)
            part = _PART_OF_SPAN.get(recs[i].name)
            if part is not None:
                parts[i] = part
                break
            i = recs[i].parent
        for j in chain:
            parts[j] = parts[i]
        return parts[i]

    out = dict.fromkeys(CATEGORIES, 0.0)
    busy = unlinked = 0.0
    if on_device:
        work = sorted((r.start_us, r.end_us) for r in recs if r.device)
        end = float("-inf")
        for s, e in work:  # the union of the intervals
            busy += max(0.0, e - max(s, end))
            end = max(end, e)
        for r in recs:
            if r.device:
                out[part_of(r.parent)] += r.end_us - r.start_us
                if r.parent is None:
                    unlinked += r.end_us - r.start_us
    else:
        children = [0.0] * n
        for r in recs:
            if not r.device and r.parent is not None:
                children[r.parent] += r.end_us - r.start_us
        for i, r in enumerate(recs):
            if not r.device:
                out[part_of(i)] += r.end_us - r.start_us - children[i]
    out = {k: v / 1e6 for k, v in out.items()}
    out["total"] = sum(out.values())
    out["busy"], out["unlinked"] = busy / 1e6, unlinked / 1e6
    return out


def records(events: Iterable) -> list[Record]:
    """`Record`s of a profile's `FunctionEvent`s (`prof.events()`, its tree built): the synchronous host events
    with their parents, then the device work, each linked to its launching host event: the op or range whose
    correlation id the device event carries (the innermost one open at the launch), or where the profiler
    dropped that event (a child merged into its parent of the same name) the runtime call (cudaLaunchKernel)
    of the same correlation, nested in whatever was open."""
    events = list(events)
    host = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    index = {id(e): i for i, e in enumerate(host)}
    frontend = {e.id: i for i, e in enumerate(host) if e.linked_correlation_id == 0}
    runtime = {
        (e.id, e.linked_correlation_id): i
        for i, e in enumerate(host)
        if e.linked_correlation_id > 0
    }
    out = [
        Record(e.name, e.time_range.start, e.time_range.end, index.get(id(e.cpu_parent)), False)
        for e in host
    ]
    for e in events:
        if e.device_type == DeviceType.CPU:
            continue
        if e.activity_type is not None and e.activity_type not in DEVICE_WORK:
            continue
        if e.activity_type is None and e.is_user_annotation:
            continue
        linked = e.linked_correlation_id
        parent = frontend.get(linked) if linked > 0 else None
        if parent is None:
            parent = runtime.get((e.id, linked))
        out.append(Record(e.name, e.time_range.start, e.time_range.end, parent, True))
    return out


def breakdown(prof, on_device: bool) -> dict[str, float]:
    """`attribute` over everything the finished profile `prof` recorded: device time when `on_device`, else
    host time (the CPU, where the ranges' own time is all there is)."""
    return attribute(records(prof.events()), on_device)
