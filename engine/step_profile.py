"""Where a forward pass's time goes, by the model's profiler ranges (`pdserve.model.deepseek.SPAN_*`): attention,
dense MLP, the MoE's exchange (dispatch and combine, waits for the other ranks included), its experts and the
rest of it (gate, shared experts, quantization), the logits, and every other kernel (norms, embedding, residual
adds). `breakdown` reads a finished `torch.profiler.profile`."""

from __future__ import annotations

from pdserve.model.deepseek import (
    SPAN_ATTENTION,
    SPAN_EXCHANGE,
    SPAN_EXPERTS,
    SPAN_LOGITS,
    SPAN_MLP,
    SPAN_MOE,
)

__all__ = ["CATEGORIES", "breakdown"]

CATEGORIES = (
    "attention",
    "dense MLP",
    "MoE exchange",
    "MoE experts",
    "MoE other",
    "logits",
    "other",
)


def breakdown(prof, on_device: bool) -> dict[str, float]:
    """Seconds per category (`CATEGORIES`) over everything `prof` recorded, and "total": device (kernel) time
    when `on_device`, else host time (the CPU, where the ranges' own time is all there is)."""

    def total(event) -> float:
        return event.device_time_total if on_device else event.cpu_time_total

    events = prof.key_averages()
    spans = {e.key: total(e) / 1e6 for e in events}
    attention, mlp, moe = (spans.get(s, 0.0) for s in (SPAN_ATTENTION, SPAN_MLP, SPAN_MOE))
    exchange, experts = spans.get(SPAN_EXCHANGE, 0.0), spans.get(SPAN_EXPERTS, 0.0)
    out = {
        "attention": attention,
        "dense MLP": mlp,
        "MoE exchange": exchange,
        "MoE experts": experts,
        "MoE other": max(0.0, moe - exchange - experts),
        "logits": spans.get(SPAN_LOGITS, 0.0),
    }
    if on_device:  # each kernel is its launching event's own time once
        everything = sum(e.self_device_time_total for e in events) / 1e6
    else:
        everything = sum(e.self_cpu_time_total for e in events) / 1e6
    out["other"] = max(0.0, everything - sum(out.values()))
    out["total"] = everything
    return out
