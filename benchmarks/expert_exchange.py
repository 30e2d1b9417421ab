"""Expert-parallel dispatch + combine (`pdserve.model.expert_exchange`) on N GPUs, every exchange side by side,
beside a bare `torch.distributed.all_to_all_single` of the same bytes in the same run.

Each rank routes T tokens of width D to top-k of E experts, drawn uniformly (DeepSeek-V3: 256 experts, top 8,
hidden 7168), then times dispatch, then combine of the rows it received (the expert computation is left out: the
received rows are sent back as they are), for each exchange:
- `all_to_all`: `AllToAllExchange` (counts, one host sync, then the rows each rank's experts need);
- `all_gather`: `AllGatherExchange` with capacity T (every rank all tokens; no count exchange, no host sync);
- `all_gather_per_step`: the same padded per step (a count all-gather and a host sync first);
- `all_gather_rs`: capacity T, combined by an fp32 reduce-scatter instead of an all-to-all of the partials;
- `symmetric` (GPUs only): `SymmetricMemoryExchange`, the all-gather's rows and sums by one-sided copies into
  the peers' symmetric-memory buffers, ordered by device-side barriers (no NCCL kernel);
- `all_gather` and `symmetric` captured in a CUDA graph (dispatch, echo, combine), replayed (GPUs only; their own
  table, last).
`--fp8` adds each exchange carrying the rows quantized (e4m3 + fp32 1x128 scales, as fp8 experts take them;
`ParallelLayout.dispatch_fp8`), combined in bf16 as before.
The peer rows move T x D values in one all_to_all_single with an even split, in bf16 and as fp8 bytes. Times are
medians of CUDA-event timings after warm-up, each call bracketed by a barrier; "host syncs" counts the
synchronizing CUDA calls of one dispatch + combine (torch.cuda's sync debug mode). Each exchange's output is
checked against the tokens' expected sums (each token gets back sum of its weights x itself) first, and the
graph's output against the eager one's, bit for bit.

`--cpu` runs the same logic over gloo on CPU processes (small default shapes, wall-clock times): a check of the
benchmark itself, not a measurement. `--profile` prints rank 0's torch.profiler table of five dispatch + combine
rounds per exchange at the first token count.

    python benchmarks/expert_exchange.py [--gpus 2] [--tokens 64,128,512,4096] [--hidden 7168] [--profile]
    python benchmarks/expert_exchange.py --cpu [--gpus 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXCHANGES = ("all_to_all", "all_gather", "all_gather_per_step", "all_gather_rs")
GPU_EXCHANGES = ("symmetric",)
"""Exchanges only CUDA runs: the one-sided copies over torch symmetric memory."""


def _exchanges(args) -> tuple[str, ...]:
    return EXCHANGES if args.cpu else EXCHANGES + GPU_EXCHANGES


CPU_DEFAULTS = {"tokens": "4,16,64", "hidden": 256, "experts": 16, "top_k": 4, "iters": 10}
GPU_DEFAULTS = {
    "tokens": "64,128,512,4096",
    "hidden": 7168,
    "experts": 256,
    "top_k": 8,
    "iters": 50,
}


def _time(fn, iters: int, device: torch.device, warmup: int = 5) -> float:
    """Median milliseconds of fn() over iters runs, each bracketed by a barrier."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cpu":
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _count_syncs(fn, device: torch.device) -> int | None:
    """Synchronizing CUDA calls fn() makes (None on CPU, where nothing waits on a device queue)."""
    if device.type == "cpu":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _make_exchange(name: str, layout, args, num_tokens: int):
    from pdserve.model.expert_exchange import AllGatherExchange, AllToAllExchange

    if name.endswith(" fp8"):  # the same exchange carrying the rows quantized (fp8 experts)
        name, layout = name[: -len(" fp8")], dataclasses.replace(layout, dispatch_fp8=True)

    if name == "all_to_all":
        return AllToAllExchange(layout, args.experts)
    if name == "symmetric":
        from pdserve.model.symmetric_exchange import SymmetricMemoryExchange

        return SymmetricMemoryExchange(layout, args.experts, num_tokens)
    capacity = None if name == "all_gather_per_step" else num_tokens
    combine_by = "reduce_scatter" if name == "all_gather_rs" else "all_to_all"
    return AllGatherExchange(layout, args.experts, capacity, combine_by)


def _tokens(rank: int, num_tokens: int, args, device: torch.device):
    g = torch.Generator(device=device).manual_seed(1000 * rank + num_tokens)
    x = torch.randn(num_tokens, args.hidden, device=device, generator=g).to(torch.bfloat16)
    scores = torch.rand(num_tokens, args.experts, device=device, generator=g)
    ids = scores.topk(args.top_k, dim=1).indices
    weights = torch.rand(num_tokens, args.top_k, device=device, generator=g)
    return x, ids, weights


def _echo(exchange, x, ids, weights, x_q=None) -> torch.Tensor:
    """Dispatch, each row times its local weights (the stand-in for the experts), combine: each token gets
    back sum over ranks of (its local weights) x itself (its fp8 rows dequantized, when they came so)."""
    batch, handle = exchange.dispatch(x, ids, weights, x_q)
    local_weight = torch.where(
        batch.topk_ids < exchange.experts_per_rank, batch.topk_weights, 0.0
    ).sum(1, keepdim=True)
    rows = batch.x.float() if batch.x_q is None else _dequantize(*batch.x_q)
    return exchange.combine((rows * local_weight).to(x.dtype), handle)


def _dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    from pdserve.kernels.fp8_quant import dequantize_act

    return dequantize_act(q, scales)


def _check(rank: int, name: str, out: torch.Tensor, x, weights) -> None:
    want = (x.float() * weights.sum(1, keepdim=True)).to(x.dtype)
    err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < 2e-2, f"rank {rank}: {name} exchange error {err:.3g} at {x.shape[0]} tokens"


def _measure(rank: int, layout, num_tokens: int, args, device) -> list[tuple]:
    """Rank `rank`'s rows of the table at `num_tokens` tokens per rank: per exchange (name, rows its
    experts computed, host syncs, dispatch, combine, dispatch + combine), then the two peer rows."""
    from pdserve.kernels.fp8_quant import quantize_act

    x, ids, weights = _tokens(rank, num_tokens, args, device)
    quantized = quantize_act(x)
    y = x.new_empty(0)  # combine's rows take x's dtype when the rows came quantized
    rows = []
    for name in _exchanges(args) + tuple(f"{e} fp8" for e in _exchanges(args) if args.fp8):
        exchange = _make_exchange(name, layout, args, num_tokens)
        x_q = quantized if name.endswith(" fp8") else None
        sent = x if x_q is None else _dequantize(*x_q).to(x.dtype)  # what the rows carry
        _check(rank, name, _echo(exchange, x, ids, weights, x_q), sent, weights)
        state = {}

        def dispatch(exchange=exchange, state=state, x_q=x_q):
            state["batch"], state["handle"] = exchange.dispatch(x, ids, weights, x_q)

        def combine(exchange=exchange, state=state):
            batch = state["batch"]
            rows = batch.x if batch.x is not None else y.new_empty(batch.num_rows, x.shape[1])
            exchange.combine(rows, state["handle"])

        def round_trip():
            dispatch()
            combine()

        syncs = _count_syncs(round_trip, device)
        t_dispatch = _time(dispatch, args.iters, device)
        dispatch()
        computed_rows = state["batch"].num_rows
        t_combine = _time(combine, args.iters, device)
        t_both = _time(round_trip, args.iters, device)
        rows.append((name, computed_rows, syncs, t_dispatch, t_combine, t_both))

    for label, dtype in (("bf16", torch.bfloat16), ("fp8 bytes", torch.uint8)):
        world = layout.worker.ranks
        even = num_tokens * args.hidden // world * world  # an even split
        send = torch.empty(even, dtype=dtype, device=device)
        recv = torch.empty_like(send)
        t_peer = _time(lambda s=send, r=recv: dist.all_to_all_single(r, s), args.iters, device)
        rows.append((f"all_to_all_single {label} (T x D)", None, None, t_peer, None, None))
    return rows


def _measure_graph(rank: int, layout, num_tokens: int, args, name: str = "all_gather") -> float:
    """Median ms of one replay of the fixed-capacity exchange `name`'s dispatch + echo + combine captured in a
    CUDA graph, after checking the replay's output equals the eager output bit for bit."""
    exchange = _make_exchange(name, layout, args, num_tokens)
    x, ids, weights = _tokens(rank, num_tokens, args, torch.device("cuda"))
    eager = _echo(exchange, x, ids, weights)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(
        side
    ):  # warm-up on the capture stream: NCCL and the allocator set up there
        for _ in range(3):
            _echo(exchange, x, ids, weights)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _echo(exchange, x, ids, weights)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), (
        f"rank {rank}: the graph's output differs at {num_tokens} tokens"
    )
    return _time(graph.replay, args.iters, torch.device("cuda"))


def _print_table(world: int, device_name: str, args, rows_by_tokens) -> None:
    print(
        f"{world} ranks ({device_name}), hidden {args.hidden}, top-{args.top_k} of {args.experts} experts, "
        "bf16, rank 0's figures (medians, ms)"
    )
    print(
        "| tokens/rank | exchange | rows computed | host syncs | dispatch | combine | dispatch + combine |"
    )
    print("|---|---|---|---|---|---|---|")

    def cell(value, fmt="{:.3f}"):
        return "" if value is None else fmt.format(value)

    for num_tokens, rows in rows_by_tokens:
        for name, computed, syncs, t_d, t_c, t_both in rows:
            print(
                f"| {num_tokens} | {name} | {cell(computed, '{}')} | {cell(syncs, '{}')} | {cell(t_d)} "
                f"| {cell(t_c)} | {cell(t_both)} |"
            )


def _profile(rank: int, layout, args, device) -> None:
    """Rank 0 prints the profiler's table of five dispatch + combine rounds per exchange."""
    from torch.profiler import ProfilerActivity, profile

    num_tokens = args.tokens[0]
    x, ids, weights = _tokens(rank, num_tokens, args, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name in _exchanges(args):
        exchange = _make_exchange(name, layout, args, num_tokens)
        _echo(exchange, x, ids, weights)
        dist.barrier()
        with profile(activities=activities) as prof:
            for _ in range(5):
                batch, handle = exchange.dispatch(x, ids, weights)
                exchange.combine(batch.x, handle)
            if device.type == "cuda":
                torch.cuda.synchronize()
        if rank == 0:
            print(f"\nprofile: {name}, {num_tokens} tokens/rank, 5 rounds")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _rank(rank: int, world: int, args) -> None:
    from pdserve.model.parallel import ParallelLayout, WorkerLayout

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        device_name = "CPU, gloo"
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        device_name = torch.cuda.get_device_name()
    layout = ParallelLayout(WorkerLayout(world, "data", expert_parallel=world), rank=rank)
    rows = [(t, _measure(rank, layout, t, args, device)) for t in args.tokens]
    if rank == 0:
        _print_table(world, device_name, args, rows)
    if args.profile:
        _profile(rank, layout, args, device)
    if not args.cpu:
        names = ("all_gather", "symmetric")
        graph = [
            (t, [_measure_graph(rank, layout, t, args, n) for n in names]) for t in args.tokens
        ]
        if rank == 0:
            print(
                "\nin a CUDA graph (dispatch + echo + combine, one replay; output equal to eager), ms"
            )
            print(f"| tokens/rank | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
            for t, times in graph:
                print(f"| {t} | {' | '.join(f'{ms:.3f}' for ms in times)} |")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="ranks (CPU processes with --cpu)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU processes, small shapes")
    p.add_argument("--tokens", help="tokens per rank, comma-separated")
    p.add_argument("--hidden", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--iters", type=int)
    p.add_argument("--profile", action="store_true", help="print rank 0's profile per exchange")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="also each exchange carrying the rows as fp8 (e4m3 + 1x128 scales), as fp8 experts take them",
    )
    args = p.parse_args()
    for key, value in (CPU_DEFAULTS if args.cpu else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if min(args.tokens) < 1:
        raise SystemExit(f"--tokens {args.tokens}: each count must be >= 1")
    if args.experts % args.gpus:
        raise SystemExit(f"--experts {args.experts} does not split over {args.gpus} ranks")
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("MASTER_PORT", "29517")
    mp.spawn(_rank, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
