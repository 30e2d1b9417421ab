"""`pdserve plan`: the per-rank memory plan of a worker's layout, printed as a table, without GPUs. Exits 0 when the
layout fits and 2 (a one-line `error: ...` naming the shortfall and what to change) when it does not."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.memory_plan import MemoryPlan
    from pdserve.model.parallel import WorkerLayout

DESCRIPTION = (
    "Plans the memory of one worker of N GPUs from the model's config alone (no GPU, no weights read): per rank "
    "the weights by group (fp8 weights with their 128x128 quant-block scales, routed experts divided over the "
    "EP ranks, attention heads divided under attention TP, MTP modules included), the activation and workspace "
    "reserve, the KV cache pages and tokens it leaves, and the worker's KV capacity. Exits 2 with a one-line "
    "error naming the shortfall when the weights and reserve do not fit, or when the KV cache cannot hold one "
    "request of --max-model-len tokens. Example: pdserve plan --preset v3-shape --gpus 8 --gpu-memory-gib 141"
)


def add_plan_command(sub) -> None:
    """Adds `plan` to `pdserve`'s subparsers."""
    p = sub.add_parser(
        "plan", help="per-rank memory plan of a multi-GPU layout (no GPU needed)",
        description=DESCRIPTION,
    )  # fmt: skip
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model", metavar="DIR", help="checkpoint directory (only config.json is read)"
    )
    src.add_argument(
        "--preset", choices=["tiny", "v2-lite-shape", "v3-shape"],
        help="a `make-checkpoint` preset's shape (v3-shape: DeepSeek-V3, 61 layers + 1 MTP)",
    )  # fmt: skip
    p.add_argument(
        "--layers", type=int, default=None, help="with --preset: main layers (default: preset's)"
    )
    p.add_argument(
        "--dtype", default="fp8", choices=["fp8", "bf16", "fp32"],
        help="with --preset: weight format (default fp8, as the official checkpoints)",
    )  # fmt: skip
    p.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) of the worker")
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=80.0,
        help="memory of each GPU, GiB (default %(default)g)",
    )
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.90,
        help="share of each GPU's memory the worker uses for weights, reserve and KV (default %(default)g)",
    )  # fmt: skip
    g = p.add_argument_group("layout")
    g.add_argument(
        "--attention", default="dp", choices=["dp", "tp"],
        help="dp: each rank all attention weights and its own requests' KV; tp: heads split over all "
        "ranks, the latent KV the same on every rank (default dp)",
    )  # fmt: skip
    g.add_argument(
        "--ep", type=int, default=None, metavar="E",
        help="expert-parallel size: routed experts split over E ranks (divides --gpus; default --gpus)",
    )  # fmt: skip
    g.add_argument(
        "--dense", default="replicated", choices=["replicated", "tp"],
        help="dense layers' MLP and shared experts: whole on every rank, or split over all ranks "
        "(default replicated)",
    )  # fmt: skip
    g.add_argument(
        "--redundant-experts", type=int, default=0, metavar="R",
        help="spare routed-expert slots per MoE layer over the expert-parallel ranks (a multiple of "
        "--ep), for copies of hot experts; each costs one expert's weights a layer (default 0)",
    )  # fmt: skip
    g.add_argument(
        "--no-mtp", action="store_true", help="leave out the multi-token-prediction modules"
    )
    k = p.add_argument_group("KV cache and steps")
    k.add_argument(
        "--page-size", type=int, default=64, help="tokens per KV page (default %(default)s)"
    )
    k.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
        help="KV rows: auto (the model dtype: 1152 B per token per layer for V3) or fp8 (656 B)",
    )  # fmt: skip
    k.add_argument(
        "--max-num-batched-tokens", type=int, default=8192,
        help="tokens one rank runs in one forward pass at most; sizes the activation and EP buffer "
        "reserve (default %(default)s)",
    )  # fmt: skip
    k.add_argument(
        "--max-running", type=int, default=256,
        help="requests of the worker per step at most, shared by data-parallel ranks (decode batch, rows "
        "of logits; default %(default)s)",
    )  # fmt: skip
    k.add_argument(
        "--max-model-len", type=int, default=None,
        help="longest request the KV cache must hold on one rank (default: the model's "
        "max_position_embeddings)",
    )  # fmt: skip
    k.add_argument(
        "--host-kv-cache-gib", type=float, default=0.0,
        help="pinned host memory per KV page set for the host tier below the prefix cache (evicted "
        "cached pages, copied back on a hit; a worker's host_kv_cache_bytes; default 0: off)",
    )  # fmt: skip


def cmd_plan(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    print(plan.format_table(args.preset or args.model))
    plan.check()
    return 0


def plan_from_args(args: argparse.Namespace) -> MemoryPlan:
    """The `MemoryPlan` that `pdserve plan` prints for its parsed arguments."""
    from pdserve.engine.memory_plan import PlanSettings, model_for_plan, plan_memory

    model_args, dtype = model_for_plan(args.model, args.preset, args.layers, args.dtype)
    layout = layout_from_args(args)
    settings = PlanSettings(
        gpu_memory_gib=args.gpu_memory_gib, gpu_memory_utilization=args.gpu_memory_utilization,
        page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens, max_running=args.max_running,
        max_model_len=args.max_model_len, use_mtp=not args.no_mtp,
        host_kv_cache_gib=args.host_kv_cache_gib,
    )  # fmt: skip
    return plan_memory(model_args, dtype, layout, settings)


FLAG_MODES = {"dp": "data", "tp": "tensor", "replicated": "replicated"}
"""`--attention` and `--dense` values (the plan's short spelling) -> `WorkerLayout`'s modes."""


def layout_from_args(args: argparse.Namespace) -> WorkerLayout:
    """The `WorkerLayout` of `pdserve plan`'s flags: --gpus ranks, --ep (default: all of them), --attention
    dp|tp and --dense replicated|tp as data|tensor and replicated|tensor, --redundant-experts."""
    from pdserve.model.parallel import WorkerLayout

    ep = args.gpus if args.ep is None else args.ep
    return WorkerLayout(
        args.gpus, FLAG_MODES[args.attention], ep, FLAG_MODES[args.dense],
        redundant_experts=args.redundant_experts,
    )  # fmt: skip
