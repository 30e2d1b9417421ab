"""Decode step of a worker of N GPUs (attention data-parallel + expert-parallel MoE) against one GPU holding all
experts, at the same batch per GPU, through the engine's own path: a `RankGroup` of N rank processes (NCCL) whose
driver sends each step plan and gathers the sampled tokens (`make_rank_runner`, CUDA graphs, all-gather
exchange), timed wall clock per step at the driver, median over `--steps`.

    python benchmarks/decode_step_ranks.py [--preset v3-shape --layers 8] [--ranks 2] [--batch 64,128]
        [--context 4096] [--steps 30] [--check] [--profile STEPS] [--two-batches]

Weights are `load_format="dummy"` (random, fp8 experts with block scales, made on each GPU from config.json), the
KV cache random rows. Per GPU: output tokens/s = batch / step; the roofline counts the weight bytes a rank reads
(its replicated weights and all its routed experts: at these batches nearly every expert is routed to), the KV
bytes of its rows, and the exchange bytes it receives (all-gather of every rank's padded rows, all-to-all of
the partial sums back), at the HBM and NVLink rates measured on the same GPUs in the same run.

--profile STEPS then runs, per batch, STEPS steps of the ranks without CUDA graphs under torch.profiler and prints
rank 0's device time a step by part (`pdserve.engine.step_profile`: attention, dense MLP, MoE exchange, experts,
the rest of the MoE, logits, sampling, other kernels; each kernel, memcpy and memset once, in the innermost range
around its launch), each beside its roofline (the same byte model, by part), and the parts' sum against the
CUDA-graph step, flagged when they differ by more than 10%. The eager steps launch each kernel on its own, so
their kernel time is close to the graph's; but the exchange's kernels also wait for the other rank, whose eager
launches may lag, so its figure is an upper bound.

--two-batches adds a row a batch: the last --dispatch kind with every decode step as two micro-batches, each MoE
layer's exchange of one in flight while the other computes (`WorkerLayout.overlap_rows`); compare its step with
the row above it, from the same run. With --check, the greedy comparison also runs the ranks so.

--check first runs a small batch-invariant greedy comparison: N ranks with B rows each against one GPU with the
same N x B rows, every row's KV filled from its own seed; the sampled tokens must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # rank processes import this file's handler

from pdserve.engine.ranks.group import RankGroup, RankGroupConfig  # noqa: E402
from pdserve.engine.ranks.process import HandlerSpec  # noqa: E402
from pdserve.engine.ranks.runner import make_rank_runner  # noqa: E402
from pdserve.engine.ranks.wire import plan_to_wire, result_from_wire  # noqa: E402
from pdserve.engine.step import DecodeRow, RankStep, SampleSpec, StepPlan  # noqa: E402
from pdserve.engine.step_profile import CATEGORIES, breakdown  # noqa: E402
from pdserve.model.deepseek import MoE  # noqa: E402
from pdserve.model.random_checkpoint import preset_config  # noqa: E402


def bench_rank(ctx, seeds: list[int] | None, pages_per_row: int, **kwargs):
    """A rank's handler for this benchmark: the engine's `RankRunner` (see `make_rank_runner`) over a cache of
    random rows (`seeds`: row r's pages [r * pages_per_row, ...) filled from seed seeds[r]; None: all random),
    plus the rank's measured HBM and NVLink rates and its weight bytes, answered to a "facts" message."""
    runner = make_rank_runner(ctx, **kwargs)
    cache = runner.runner.cache
    gen = torch.Generator(device=cache.device)
    if seeds is None:
        gen.manual_seed(1000 + ctx.rank)
        cache.data.normal_(generator=gen)
    else:
        for r, seed in enumerate(seeds):
            gen.manual_seed(seed)
            cache.data[r * pages_per_row : (r + 1) * pages_per_row].normal_(generator=gen)
    facts = _facts(ctx, runner.runner.model)
    profiling = []

    def handler(wire):
        if wire == "facts":
            return facts
        if wire == "profile_start":
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            profiling.append(torch.profiler.profile(activities=activities))
            profiling[0].__enter__()
            return None
        if wire == "profile_stop":
            torch.cuda.synchronize()
            prof = profiling.pop()
            prof.__exit__(None, None, None)
            return breakdown(prof, on_device=True)
        return runner(wire)

    handler.close = runner.close  # its CUDA graphs go before the group is destroyed
    handler.model = runner.runner.model
    return handler


def _facts(ctx, model) -> dict:
    torch.cuda.synchronize()
    a = torch.empty(1 << 28, dtype=torch.uint8, device=ctx.device)  # 256 MiB
    b = torch.empty_like(a)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    hbm = 2 * a.numel() / statistics.median(times)
    link = None
    if ctx.world_size > 1:
        x = torch.empty(1 << 26, dtype=torch.bfloat16, device=ctx.device)  # 128 MiB a rank
        out = torch.empty(ctx.world_size * x.numel(), dtype=x.dtype, device=ctx.device)
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dist.all_gather_into_tensor(out, x, group=ctx.group)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        link = (ctx.world_size - 1) * x.numel() * 2 / statistics.median(times)  # bytes in a rank
    skip = {id(p) for m in model.mtp for p in m.parameters()} | {id(model.embed.weight)}
    weight_bytes = sum(
        p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip
    )
    del a, b
    torch.cuda.empty_cache()
    return {
        "hbm": hbm, "link": link, "weight_bytes": weight_bytes,
        "part_bytes": _part_bytes(model, weight_bytes),
    }  # fmt: skip


def _part_bytes(model, weight_bytes: int) -> dict[str, int]:
    """The weight bytes a step reads in each `step_profile` part; "other" (the norms) is what is left of
    `weight_bytes`, so that the parts add up to it."""
    seen: set[int] = set()

    def size(module) -> int:
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        return sum(p.numel() * p.element_size() for p in params)

    parts = dict.fromkeys(CATEGORIES, 0)
    for layer in model.layers:
        parts["attention"] += size(layer.attn)
        if isinstance(layer.ffn, MoE):
            parts["MoE experts"] += size(layer.ffn.experts)
            parts["MoE other"] += size(layer.ffn)  # the gate and shared experts
        else:
            parts["dense MLP"] += size(layer.ffn)
    parts["logits"] = size(model.head)
    parts["other"] = weight_bytes - sum(parts.values())
    return parts


def run(model_dir: str, ranks: int, batch: int, context: int, steps: int, invariant: bool,
        seeds: list[list[int]] | None, dispatch_fp8: bool = False, profile_steps: int = 0,
        layout_extra: dict | None = None, handler: str | None = None,
        handler_args: dict | None = None) -> dict:  # fmt: skip
    """One group of `ranks` ranks, `batch` rows each, `steps` timed steps; returns times and tokens.
    dispatch_fp8: the exchange carries the fp8 experts' rows quantized (`ParallelLayout.dispatch_fp8`).
    profile_steps: instead, that many steps without CUDA graphs under torch.profiler after 5 warm-up steps;
    "profile" is then each rank's device seconds a step by part (`engine.step_profile.breakdown`).
    layout_extra: more `WorkerLayout` fields; handler ("module:function", importable from this folder) and
    handler_args: another rank handler taking `_by_rank`'s arguments and these."""
    pages_per_row = -(-(context + steps + 8) // 64)
    layout = {"ranks": ranks, "attention": "data", "expert_parallel": ranks, "dense": "replicated"}
    layout.update(layout_extra or {})
    spec = HandlerSpec(
        # this file, imported by the rank processes (sys.path carries it)
        handler or f"{Path(__file__).stem}:_by_rank",
        {
            **(handler_args or {}),
            "seeds": [None] * ranks if seeds is None else seeds, "pages_per_row": pages_per_row,
            "model_path": model_dir, "dtype": "bf16", "layout": layout, "page_size": 64,
            "num_pages": batch * pages_per_row, "gpu_memory_fraction": 0.9, "cpu_cache_bytes": 0,
            "kv_cache_dtype": "auto", "load_format": "dummy", "batch_invariant": invariant,
            "cuda_graphs": not profile_steps, "layout_options": {"dispatch_fp8": dispatch_fp8},
        },
    )  # fmt: skip
    config = RankGroupConfig(ranks, backend="nccl", join_timeout_s=600, step_timeout_s=600)
    with RankGroup(config, spec) as group:
        facts = group.step("facts")
        tokens = [[3 + (r * batch + b) % 1000 for b in range(batch)] for r in range(ranks)]
        times, history = [], []
        if profile_steps:
            steps = profile_steps
        for step in range(steps + 5):
            if profile_steps and step == 5:
                group.step("profile_start")
            pos = context + step
            plan = StepPlan(
                step,
                [
                    RankStep(
                        decode=[
                            DecodeRow(
                                f"{r}-{b}",
                                tokens[r][b],
                                pos,
                                list(range(b * pages_per_row, (b + 1) * pages_per_row)),
                                SampleSpec(0.0, 1.0, -1, 0.0, 0, step),
                            )  # fmt: skip
                            for b in range(batch)
                        ]
                    )
                    for r in range(ranks)
                ],
            )
            wire = [plan_to_wire(plan), None]
            start = time.perf_counter()
            replies = group.step(wire)
            elapsed = time.perf_counter() - start
            results = [result_from_wire(reply[0]) for reply in replies]
            for r, result in enumerate(results):
                if result.decode_error is not None:
                    raise RuntimeError(f"rank {r}: decode step failed: {result.decode_error}")
                tokens[r] = result.decode_tokens
            history.append([t for r in range(ranks) for t in tokens[r]])
            if step >= 5:
                times.append(elapsed)
        profile = None
        if profile_steps:
            profile = [{k: v / steps for k, v in p.items()} for p in group.step("profile_stop")]
    return {
        "step_s": statistics.median(times),
        "times": times,
        "facts": facts,
        "tokens": history,
        "profile": profile,
    }


def _by_rank(ctx, seeds, **kwargs):
    return bench_rank(ctx, seeds[ctx.rank], **kwargs)


def roofline(cfg: dict, ranks: int, batch: int, context: int, facts: list[dict],
             dispatch_fp8: bool = False) -> float:  # fmt: skip
    """Seconds a step of `batch` rows per rank needs at least on rank 0: its bytes over the measured rates."""
    return sum(roofline_parts(cfg, ranks, batch, context, facts, dispatch_fp8).values())


def roofline_parts(cfg: dict, ranks: int, batch: int, context: int, facts: list[dict],
                   dispatch_fp8: bool = False) -> dict[str, float]:  # fmt: skip
    """`roofline` by `step_profile` part: each part's weight bytes over HBM, the KV rows in attention, the fp32
    logits written (logits) and read (sampling), the exchange's received bytes over the link."""
    f = facts[0]
    layers = cfg["num_hidden_layers"]
    moe_layers = layers - min(cfg["first_k_dense_replace"], layers)
    kv_row = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    kv = batch * context * layers * kv_row
    logits = batch * cfg["vocab_size"] * 4
    parts = {name: b / f["hbm"] for name, b in f["part_bytes"].items()}
    parts["attention"] += kv / f["hbm"]
    parts["logits"] += logits / f["hbm"]
    parts["sampling"] += logits / f["hbm"]
    if ranks > 1:
        hidden = cfg["hidden_size"]
        # all-gather: the other ranks' padded rows (activations + ids + weights, ~16 B of routing a row);
        # combine: the other ranks' partial sums of this rank's rows
        # (fp8 rows: 1 byte a value plus an fp32 scale per 128)
        x_bytes = hidden + 4 * (-(-hidden // 128)) if dispatch_fp8 else hidden * 2
        row = x_bytes + cfg["num_experts_per_tok"] * 8
        received = (ranks - 1) * batch * (row + hidden * 2) * moe_layers
        parts["MoE exchange"] += received / f["link"]
    return parts


PROFILE_TOLERANCE = 0.10
"""How far the profiled parts' sum may be from the CUDA-graph step before the table flags it."""


def profile_table(ranks: list[dict], roof: dict, graph_step_s: float, batch: int, layers: int,
                  kind: str) -> str:  # fmt: skip
    """Rank 0's device time a step by part (eager steps under the profiler; `ranks`: every rank's
    `breakdown` a step) beside each part's roofline, and the parts' sum against the CUDA-graph step."""
    parts = ranks[0]
    rows = [
        f"\nrank 0 at {batch} rows, {kind} dispatch, device time a step by part (eager, profiled: each "
        f"kernel, memcpy and memset once) against the CUDA-graph step of {1e3 * graph_step_s:.2f} ms",
        "| part | ms a step | us a layer | roofline ms | part/roofline | share of the graph step |",
        "|---|---|---|---|---|---|",
    ]
    for name in CATEGORIES:
        ms, roof_ms = 1e3 * parts[name], 1e3 * roof[name]
        ratio = f"{parts[name] / roof[name]:.2f}x" if roof[name] > 0 else "-"
        rows.append(
            f"| {name} | {ms:.3f} | {1e3 * ms / layers:.1f} | {roof_ms:.3f} | {ratio} | "
            f"{parts[name] / graph_step_s:.0%} |"
        )
    total, roof_total = parts["total"], sum(roof.values())
    rows.append(
        f"| sum of the parts | {1e3 * total:.3f} | | {1e3 * roof_total:.3f} | "
        f"{total / roof_total:.2f}x | {total / graph_step_s:.0%} |"
    )
    off = total / graph_step_s - 1
    verdict = "within" if abs(off) <= PROFILE_TOLERANCE else "OFF BY MORE THAN"
    notes = [
        f"parts' sum {1e3 * total:.2f} ms vs CUDA-graph step {1e3 * graph_step_s:.2f} ms: {off:+.1%}, "
        f"{verdict} {PROFILE_TOLERANCE:.0%}"
        + ("" if abs(off) <= PROFILE_TOLERANCE else " (see the notes below)"),
        "MoE exchange: its kernels' time includes waiting for the other ranks, whose eager launches may "
        "lag behind this rank's: an upper bound on the exchange itself (by rank: "
        + ", ".join(f"{1e3 * r['MoE exchange']:.2f}" for r in ranks)
        + " ms; the last to arrive waits least)",
        f"device busy {1e3 * parts['busy']:.2f} ms (union of the parts' intervals; below their sum where "
        f"streams overlap)",
        "the graph step is wall time at the driver: it also holds the host's work between replays",
    ]
    if parts["unlinked"] > 0:
        notes.append(
            f"{1e3 * parts['unlinked']:.3f} ms of device work had no launching host event (in other): "
            "launched outside any op or range, or its launch not recorded"
        )
    return "\n".join(rows + [""] + [f"- {n}" for n in notes])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="v3-shape")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", default="64,128", help="rows per GPU, comma-separated")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--check", action="store_true", help="first the batch-invariant greedy comparison"
    )
    p.add_argument(
        "--profile", type=int, default=0, metavar="STEPS",
        help="also, per batch, STEPS decode steps of the ranks without CUDA graphs under torch.profiler: each "
        "part's device time a step on rank 0 (attention, MoE exchange, experts, ..., sampling) beside its "
        "roofline, and the parts' sum against the CUDA-graph step",
    )  # fmt: skip
    p.add_argument(
        "--two-batches", action="store_true",
        help="also the last --dispatch kind with each decode step as two micro-batches whose expert "
        "exchanges overlap the other's compute (the layout's overlap_rows)",
    )  # fmt: skip
    p.add_argument(
        "--dispatch",
        default="bf16",
        help="how the exchange carries the experts' rows, comma-separated: bf16, fp8 (a row per kind)",
    )
    args = p.parse_args()
    cfg = preset_config(args.preset, args.layers, "fp8")
    out = {"device": torch.cuda.get_device_name(), "preset": args.preset, "layers": args.layers}
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(cfg))
        if args.check:
            b, ctx, n = 8, 256, 6
            seeds = [[r * b + i for i in range(b)] for r in range(args.ranks)]
            many = run(tmp, args.ranks, b, ctx, n, True, seeds)
            one = run(tmp, 1, args.ranks * b, ctx, n, True, [sum(seeds, [])])
            equal = many["tokens"] == one["tokens"]
            out["check"] = {"equal": equal, "rows": args.ranks * b, "steps": n + 5}
            lines.append(
                f"greedy, batch-invariant, {args.ranks} ranks x {b} rows vs 1 GPU x {args.ranks * b} "
                f"rows, {n + 5} steps at context {ctx}: {'EQUAL' if equal else 'DIFFERENT'}"
            )
            if args.two_batches:  # the same ranks, each step as two overlapped micro-batches
                two = run(tmp, args.ranks, b, ctx, n, True, seeds, layout_extra={"overlap_rows": 2})
                same = two["tokens"] == one["tokens"]
                out["check"]["two_batches_equal"] = same
                equal = equal and same
                lines.append(
                    f"the same with two micro-batches a step: {'EQUAL' if same else 'DIFFERENT'}"
                )
            if not equal:
                print("\n".join(lines))
                sys.exit(1)
        lines.append(
            "| batch/GPU | GPUs | step | tok/s per GPU | vs 1 GPU | roofline | step/roofline |\n"
            "|---|---|---|---|---|---|---|"
        )
        out["rows"] = []
        kinds = args.dispatch.split(",")
        for kind in kinds:
            if kind not in ("bf16", "fp8"):
                p.error(f"--dispatch: {kind!r} is not bf16 or fp8")
        for batch in [int(x) for x in args.batch.split(",")]:
            res = {}
            cases = [(1, "bf16", False)] + [(args.ranks, k, False) for k in kinds]
            if args.two_batches:
                cases.append((args.ranks, kinds[-1], True))
            for ranks, kind, two in cases:
                fp8 = kind == "fp8"
                extra = {"overlap_rows": 2} if two else None
                r = run(tmp, ranks, batch, args.context, args.steps, False, None, fp8,
                        layout_extra=extra)  # fmt: skip
                res.setdefault(ranks, r)
                roof = roofline(cfg, ranks, batch, args.context, r["facts"], fp8)
                tps = batch / r["step_s"]
                ratio = tps / (batch / res[1]["step_s"])
                name = f"{ranks}" if ranks == 1 else f"{ranks} ({kind} dispatch)"
                if two:
                    name = f"{ranks} ({kind} dispatch, two micro-batches)"
                lines.append(
                    f"| {batch} | {name} | {1e3 * r['step_s']:.2f} ms | {tps:.0f} | {ratio:.2f}x | "
                    f"{1e3 * roof:.2f} ms | {r['step_s'] / roof:.2f}x |"
                )
                out["rows"].append(
                    {
                        "batch": batch,
                        "ranks": ranks,
                        "dispatch": kind,
                        "two_batches": two,
                        "step_s": r["step_s"],
                        "roofline_s": roof,
                        "facts": r["facts"],
                    }  # fmt: skip
                )
            if args.profile:
                kind = kinds[-1]
                prof = run(tmp, args.ranks, batch, args.context, 0, False, None, kind == "fp8",
                           args.profile)["profile"]  # fmt: skip
                graph = next(
                    row for row in out["rows"]
                    if (row["batch"], row["ranks"], row["dispatch"], row["two_batches"])
                    == (batch, args.ranks, kind, False)
                )  # fmt: skip
                graph_step = graph["step_s"]
                roof = roofline_parts(
                    cfg, args.ranks, batch, args.context, graph["facts"], kind == "fp8"
                )
                out.setdefault("profiles", []).append(
                    {"batch": batch, "dispatch": kind, "graph_step_s": graph_step, "ranks": prof,
                     "roofline_s": roof}
                )  # fmt: skip
                lines.append(profile_table(prof, roof, graph_step, batch, args.layers, kind))
    header = (
        f"{out['device']} | {args.preset}, {args.layers} layers, fp8 experts, dummy weights | context "
        f"{args.context} | DP{args.ranks} + EP{args.ranks} vs 1 GPU | CUDA graphs"
    )
    text = "\n".join([header, *lines])
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "decode_step_ranks.md").write_text(text + "\n")
        Path(os.environ["OUT"], "decode_step_ranks.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
