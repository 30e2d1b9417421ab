"""Expert balancing under skewed routing: spare slots holding copies of hot experts (`--decode.redundant-experts`,
`pdserve.model.expert_balance`) against the same skew without them and against balanced routing.

    python benchmarks/expert_balance.py --placement [--zipf 1.0] [--tokens 4096]          # CPU
    python benchmarks/expert_balance.py [--ranks 2] [--layers 8] [--batch 64,128] [--zipf 1.0]
        [--spares 2] [--steps 40]                                                            # GPUs

--placement (no GPU): the engine's routing code (`ExpertRouting`, `plan_spares`) over V3's 256 experts, top-8:
a first batch of `--tokens` tokens a rank, each drawing its 8 distinct experts from a Zipf law (the i-th
hottest expert, at a random id, weighs 1/i^s), is counted, the spares are placed from the counts, and a second
batch from the same law is routed; printed per layout: the routed rows on the busiest rank over the mean, with
no spares and with them.

GPUs: the multi-rank decode step of `decode_step_ranks.py` (attention DP + EP over NCCL, v3 shape, fp8
experts, CUDA graphs), its routers replaced by fixed routes a row (`--zipf` law, or uniform), per batch:
uniform routing without spares, the skewed routing without spares, and the skewed routing with `--spares`
spare slots a rank. With spares, the ranks count the first 10 steps, place the copies and move them in the
11th step's wake; the step is the median of the steps after the move, and the moving step is printed beside
it (the stall a rebalance costs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # rank processes import this file's handler

from pdserve.model.expert_balance import (  # noqa: E402
    NO_EXPERT,
    ExpertRouting,
    SlotLayout,
    plan_spares,
)

NUM_EXPERTS, TOP_K = 256, 8
REBALANCE_STEPS = 10
"""Steps counted before the copies are placed (the benchmark's own; the serving default is 1000)."""


def zipf_routes(rows: int, num_experts: int, k: int, exponent: float, perm_seed: int, seed: int):
    """[rows, k] distinct expert ids a row, each row drawing k experts without replacement from a Zipf law
    over a random order of the experts (`perm_seed`: the order, the same on every rank; exponent 0:
    uniform)."""
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(perm_seed))
    logp = torch.empty(num_experts)
    logp[order] = -exponent * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float32))
    gen = torch.Generator().manual_seed(seed)
    gumbel = -torch.log(-torch.log(torch.rand(rows, num_experts, generator=gen).clamp_min(1e-20)))
    return (logp + gumbel).topk(k, dim=1).indices  # [rows, k]


def placement(args) -> tuple[list[str], list[dict]]:
    """The --placement table: the busiest rank's routed rows over the mean, before and after."""
    lines = [
        f"Zipf s={args.zipf} over {NUM_EXPERTS} experts, top-{TOP_K}, {args.tokens} tokens a rank: routed "
        "rows on the busiest rank / the mean",
        "| ranks | spares a rank | no spares | with spares | copies placed |",
        "|---|---|---|---|---|",
    ]
    rows_out = []
    for ranks in (2, 4, 8):
        for spares in (1, 2, 4):
            slots = SlotLayout(NUM_EXPERTS, ranks, spares)
            routing = ExpertRouting(slots, "cpu")
            first = zipf_routes(ranks * args.tokens, NUM_EXPERTS, TOP_K, args.zipf, 0, 1)
            before = _rank_rows(routing.route(first, None, home_only=False), slots)
            routing.set_spares(plan_spares(routing.take_load().tolist(), slots))
            second = zipf_routes(ranks * args.tokens, NUM_EXPERTS, TOP_K, args.zipf, 0, 2)
            after = _rank_rows(routing.route(second, None, home_only=False), slots)
            placed = sum(e != NO_EXPERT for held in routing.spares for e in held)
            lines.append(f"| {ranks} | {spares} | {_imbalance(before):.3f} | {_imbalance(after):.3f} "
                         f"| {placed} |")  # fmt: skip
            rows_out.append({"ranks": ranks, "spares": spares, "before": before, "after": after})
    return lines, rows_out


def _rank_rows(slot_ids: torch.Tensor, slots: SlotLayout) -> list[int]:
    return torch.bincount(
        slot_ids.reshape(-1) // slots.slots_per_rank, minlength=slots.ranks
    ).tolist()


def _imbalance(rows: list[int]) -> float:
    return max(rows) / (sum(rows) / len(rows))


def balance_rank(ctx, seeds, routing: str, max_rows: int, **kwargs):
    """`decode_step_ranks`' rank handler with each MoE layer's router replaced by fixed routes a row:
    `routing` 'uniform' or 'zipf:S' (layer i's hot experts in its own random order, the same on every
    rank), weights 1/k; row r of a step takes route r of this rank's table."""
    from decode_step_ranks import bench_rank

    from pdserve.model.deepseek import MoE

    handler = bench_rank(ctx, seeds[ctx.rank], **kwargs)
    exponent = 0.0 if routing == "uniform" else float(routing.split(":", 1)[1])
    for i, layer in enumerate(handler.model.layers):
        if not isinstance(layer.ffn, MoE):
            continue
        gate = layer.ffn.gate
        e, k = gate.weight.shape[0], gate.args.num_experts_per_tok
        ids = zipf_routes(max_rows, e, k, exponent, i, 1000 * i + ctx.rank).to(ctx.device)
        weights = torch.full((max_rows, k), 1.0 / k, device=ctx.device)

        def fixed(x, num_shared=0, ids=ids, weights=weights):
            return weights[: x.shape[0]], ids[: x.shape[0]]

        gate.forward = fixed
    return handler


def gpu_runs(args) -> tuple[list[str], list[dict]]:
    from decode_step_ranks import run

    from pdserve.model.random_checkpoint import preset_config

    cfg = preset_config(args.preset, args.layers, "fp8")
    skew = f"zipf:{args.zipf}"
    cases = [("uniform", 0), (skew, 0), (skew, args.spares * args.ranks)]
    lines = [
        f"{torch.cuda.get_device_name()} | {args.preset}, {args.layers} layers, fp8 experts | DP{args.ranks} + "
        f"EP{args.ranks}, context {args.context}, CUDA graphs | routes fixed a row",
        "| batch/GPU | routing | spare slots | step | vs uniform | the moving step |",
        "|---|---|---|---|---|---|",
    ]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(cfg))
        for batch in [int(b) for b in args.batch.split(",")]:
            uniform = None
            for routing, redundant in cases:
                extra = {}
                if redundant:
                    extra = {"redundant_experts": redundant, "rebalance_steps": REBALANCE_STEPS}
                r = run(tmp, args.ranks, batch, args.context, args.steps, False, None, True,
                        layout_extra=extra, handler="expert_balance:balance_rank",
                        handler_args={"routing": routing, "max_rows": 512})  # fmt: skip
                times = r["times"]  # step i + 5 of the run
                moving = None
                if redundant:  # counted through step 9, moved in step 10's wake, steady from 12
                    moving = times[REBALANCE_STEPS - 5]
                    times = times[REBALANCE_STEPS - 5 + 2 :]
                step = statistics.median(times)
                uniform = uniform or step
                lines.append(
                    f"| {batch} | {routing} | {redundant} | {1e3 * step:.2f} ms | {step / uniform:.3f}x | "
                    + (f"{1e3 * moving:.2f} ms |" if moving is not None else " |")
                )
                out.append({"batch": batch, "routing": routing, "redundant_experts": redundant,
                            "step_s": step, "moving_step_s": moving, "times": r["times"]})  # fmt: skip
    return lines, out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--placement", action="store_true", help="the CPU table of the routing code alone"
    )
    p.add_argument("--zipf", type=float, default=1.0, help="the skew's exponent s (default 1.0)")
    p.add_argument(
        "--tokens", type=int, default=4096, help="--placement: tokens a rank (default 4096)"
    )
    p.add_argument("--preset", default="v3-shape")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", default="64,128", help="rows per GPU, comma-separated")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument(
        "--steps", type=int, default=40, help="timed steps (>= 20: the move is at step 10)"
    )
    p.add_argument("--spares", type=int, default=2, help="spare slots a rank (default 2)")
    args = p.parse_args()
    if args.zipf < 0 or not math.isfinite(args.zipf):
        p.error(f"--zipf {args.zipf}: must be a finite number >= 0")
    if args.placement:
        lines, rows = placement(args)
    else:
        if not torch.cuda.is_available() or torch.cuda.device_count() < args.ranks:
            p.error(f"needs {args.ranks} CUDA GPUs (--placement runs on the CPU)")
        if args.steps < 20:
            p.error(f"--steps {args.steps}: at least 20 (the copies move at step 10)")
        lines, rows = gpu_runs(args)
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        name = "expert_balance_placement" if args.placement else "expert_balance"
        Path(os.environ["OUT"], f"{name}.md").write_text(text + "\n")
        Path(os.environ["OUT"], f"{name}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
