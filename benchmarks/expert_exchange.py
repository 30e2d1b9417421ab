"""Expert-parallel dispatch + combine (`pdserve.model.expert_exchange`) on N GPUs, beside a bare
`torch.distributed.all_to_all_single` of the same bytes in the same run.

Each rank routes T tokens of width D to top-k of E experts, drawn uniformly (DeepSeek-V3: 256 experts, top 8,
hidden 7168), then times dispatch, then combine of the rows it received (the expert computation is left out: the
received rows are sent back as they are). The peer row moves T x D values in one all_to_all_single with an even
split, in bf16 and as fp8 bytes. Times are medians of CUDA-event timings after warm-up; the exchange's output is
checked against the tokens' expected sums (each token gets back sum of its weights x itself, in fp32) first.

    python benchmarks/expert_exchange.py [--gpus 2] [--tokens 64,128,512,4096] [--hidden 7168]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, iters: int, warmup: int = 5) -> float:
    """Median milliseconds of fn() over iters runs, each bracketed by a barrier."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _measure(rank: int, exchange, num_tokens: int, args) -> tuple:
    """One row of the table: rank `rank`'s timings at `num_tokens` tokens per rank."""
    g = torch.Generator(device="cuda").manual_seed(1000 * rank + num_tokens)
    x = torch.randn(num_tokens, args.hidden, device="cuda", generator=g).to(torch.bfloat16)
    scores = torch.rand(num_tokens, args.experts, device="cuda", generator=g)
    ids = scores.topk(args.top_k, dim=1).indices
    weights = torch.rand(num_tokens, args.top_k, device="cuda", generator=g)

    # correctness: echoing the rows back gives each token sum over ranks of (its local weights) x itself
    batch, handle = exchange.dispatch(x, ids, weights)
    local_weight = torch.where(
        batch.topk_ids < exchange.experts_per_rank, batch.topk_weights, 0.0
    ).sum(1, keepdim=True)
    out = exchange.combine((batch.x.float() * local_weight).to(x.dtype), handle)
    want = (x.float() * weights.sum(1, keepdim=True)).to(x.dtype)
    err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < 2e-2, f"rank {rank}: exchange error {err:.3g} at {num_tokens} tokens"

    state = {}

    def dispatch():
        state["batch"], state["handle"] = exchange.dispatch(x, ids, weights)

    def combine():
        exchange.combine(state["batch"].x, state["handle"])

    t_dispatch = _time(dispatch, args.iters)
    dispatch()
    sent_rows = len(state["handle"].tokens)
    off_rank_rows = sent_rows - state["handle"].send_counts[rank]
    t_combine = _time(combine, args.iters)

    def a2a(dtype):
        send = torch.empty(num_tokens * args.hidden, dtype=dtype, device="cuda")
        recv = torch.empty_like(send)
        return lambda: dist.all_to_all_single(recv, send)

    t_a2a_bf16 = _time(a2a(torch.bfloat16), args.iters)
    t_a2a_fp8 = _time(a2a(torch.uint8), args.iters)
    off_bytes = off_rank_rows * args.hidden * 2
    return num_tokens, sent_rows, t_dispatch, t_combine, t_a2a_bf16, t_a2a_fp8, off_bytes


def _rank(rank: int, world: int, args) -> None:
    from pdserve.model.expert_exchange import AllToAllExchange
    from pdserve.model.parallel import ParallelLayout

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )
    layout = ParallelLayout(world_size=world, rank=rank, attention="data", expert_parallel=world)
    exchange = AllToAllExchange(layout, args.experts)
    rows = [_measure(rank, exchange, t, args) for t in args.tokens]
    if rank == 0:
        print(f"{world} GPUs ({torch.cuda.get_device_name()}), hidden {args.hidden}, "
              f"top-{args.top_k} of {args.experts} experts, rank 0's figures (medians, ms)")  # fmt: skip
        print("| tokens/rank | rows sent | dispatch bf16 | combine bf16 | dispatch GB/s off-rank "
              "| all_to_all_single bf16 | all_to_all_single fp8 bytes |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for t, sent, d, c, ab, af, off in rows:
            print(
                f"| {t} | {sent} | {d:.3f} | {c:.3f} | {off / d / 1e6:.0f} | {ab:.3f} | {af:.3f} |"
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--tokens", default="64,128,512,4096", help="tokens per rank, comma-separated")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("MASTER_PORT", "29517")
    mp.spawn(_rank, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
