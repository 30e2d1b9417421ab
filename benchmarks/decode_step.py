"""Decode step time on one GPU against the memory roofline (weight bytes + KV bytes read, over 4.27 TB/s).

    python benchmarks/decode_step.py MODEL_DIR [--batch 64] [--context 1024] [--steps 30] [--page-size 64]
        [--kv-cache-dtype auto,fp8]

Fills the KV cache of `batch` requests with `context` random latent tokens each, then times full decode steps
through the same `ModelRunner.execute` the decode worker calls (batch building, forward, logits, sampling), wall
clock with the device synchronized, median over `steps`. Weight bytes count every parameter a decode step reads:
all of them except the MTP module's and the embedding table (one row per token), with routed experts counted only
when some token of the step is routed to them (measured on the step's actual routing)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import HBM_BYTES_PER_S  # noqa: E402


def main() -> None:
    from pdserve.model.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--page-size", default="64", help="one or more, comma-separated")
    parser.add_argument(
        "--device", default="cuda", help="cuda (the measurement) or cpu (a dry run)"
    )
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto and/or fp8, comma-separated")
    args = parser.parse_args()
    model = load_model(args.model, args.device, torch.bfloat16)
    lines = []
    page_sizes = [int(p) for p in args.page_size.split(",")]
    for kv_dtype in args.kv_cache_dtype.split(","):
        for page_size in page_sizes:
            lines.append(measure(model, args, page_size, kv_dtype))
            torch.cuda.empty_cache()
    header = (
        f"{device_name(args.device)} | {args.model} | batch {args.batch} x context {args.context} | "
        f"{'eager' if args.eager else 'CUDA graphs'}\n"
        f"| page | KV rows | step (median of {args.steps}) | weights read | experts touched | KV read "
        f"| roofline | ratio |\n|---|---|---|---|---|---|---|---|"
    )
    text = "\n".join([header, *lines])
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "decode_step.md").write_text(text + "\n")


def device_name(device: str) -> str:
    return "cpu" if device == "cpu" else torch.cuda.get_device_name()


def fill_cache(cache) -> None:
    """Random rows: normal values, or for fp8 rows normal values quantized (random bytes would hold NaN
    codes and scales)."""
    if not cache.layout.is_fp8:
        cache.data.normal_()
        return
    from pdserve.kernels.mla_decode import quantize_kv_fp8

    lora, rope = cache.layout.kv_lora_rank, cache.layout.rope_dim
    flat = cache.data.view(-1, cache.layout.entry_dim)
    for start in range(0, flat.shape[0], 1 << 18):
        n = min(1 << 18, flat.shape[0] - start)
        c = torch.randn(n, lora + rope, device=flat.device)
        flat[start : start + n] = quantize_kv_fp8(c[:, :lora], c[:, lora:])


def measure(model, args, page_size: int, kv_cache_dtype: str) -> str:
    from pdserve.engine.runner import ModelRunner
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.step import DecodeRow, RankStep, SampleSpec, StepPlan
    from pdserve.model.batch import SeqChunk, build_forward_batch
    from pdserve.model.deepseek import Experts

    args.page_size = page_size

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    pages_per_seq = -(-(args.context + args.steps + 8) // args.page_size)
    runner = ModelRunner(
        model, args.page_size, args.batch * pages_per_seq, kv_cache_dtype, not args.eager
    )
    fill_cache(runner.cache)
    tables = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(args.batch)]
    params = SamplingParams(max_tokens=10**6, seed=0)
    tokens = torch.randint(3, model.args.vocab_size, (args.batch,)).tolist()

    hits: set[tuple[int, int]] = set()

    routed = model.args.n_routed_experts

    def record(module, inputs, output):
        weights, ids = output  # a fused shared expert rides as id E: counted with the other weights
        hits.update((id(module), e) for e in ids.flatten().tolist() if e < routed)

    # One eager step with hooks on the routers to see which experts a step touches (hooks cannot run inside
    # graph capture); the timed steps run as the decode worker runs them.
    gates = [layer.ffn.gate for layer in model.layers if hasattr(layer.ffn, "gate")]
    hooks = [g.register_forward_hook(record) for g in gates]
    probe = [SeqChunk([t], args.context, tables[b]) for b, t in enumerate(tokens)]
    with torch.inference_mode():
        model(
            build_forward_batch(probe, args.page_size, model.embed.weight.device, True),
            runner.cache,
        )
    for h in hooks:
        h.remove()
    times = []
    for step in range(args.steps + 5):
        pos = args.context + step
        rows = [
            DecodeRow(str(b), t, pos, tables[b], SampleSpec.of(params, step))
            for b, t in enumerate(tokens)
        ]
        plan = StepPlan(step, [RankStep(decode=rows)])
        sync()
        start = time.perf_counter()
        result = runner.execute(plan)
        sync()
        if result.decode_error is not None:
            raise RuntimeError(f"decode step failed: {result.decode_error}")
        tokens = result.decode_tokens
        if step >= 5:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    expert_bytes = 0
    experts_touched = 0
    for layer in model.layers:
        ffn = layer.ffn
        if not hasattr(ffn, "gate"):
            continue
        per_expert = sum(nbytes(p[0]) for p in (ffn.experts.w13, ffn.experts.w2))
        touched = sum(1 for (g, _) in hits if g == id(ffn.gate))
        experts_touched += touched
        expert_bytes += touched * per_expert
    skip = {id(p) for m in model.mtp for p in m.parameters()} | {id(model.embed.weight)}
    skip |= {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
    # the shared experts are counted here, also when stored as a slot of the stacked experts
    other_bytes = sum(nbytes(p) for p in model.parameters() if id(p) not in skip)
    row_bytes = runner.cache.layout.entry_dim * runner.cache.data.element_size()
    kv_bytes = args.batch * args.context * model.args.num_hidden_layers * row_bytes
    total = other_bytes + expert_bytes + kv_bytes
    roofline_s = total / HBM_BYTES_PER_S
    return (
        f"| {page_size} | {kv_cache_dtype} | {1e3 * step_s:.2f} ms | {(other_bytes + expert_bytes) / 1e9:.2f} GB | "
        f"{experts_touched} | {kv_bytes / 1e9:.2f} GB | {1e3 * roofline_s:.2f} ms | "
        f"{step_s / roofline_s:.2f}x |"
    )


if __name__ == "__main__":
    main()
