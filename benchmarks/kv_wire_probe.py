"""How fast NCCL moves a KV transfer's bytes between two GPUs when they are sent straight from the cache's page
runs (no packing), against one contiguous send: the wire alone, receives posted before the sends.

    python benchmarks/kv_wire_probe.py [--tokens 8192] [--layers 27] [--page-size 16] [--iters 20]

Cases: one contiguous send; per layer one send of a page run (coalesced into one NCCL group, and not); per layer
several runs. Prints one table (median ms from posting the sends until the receives completed on D, and P's
host time to post)."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DIM = 576


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _views(cache, layers, n, runs):
    """Per layer, `runs` slices of pages [0, n) of the cache (page runs of equal size)."""
    bounds = [round(i * n / runs) for i in range(runs + 1)]
    return [
        cache[i, a:b] for i in range(layers) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def _run(rank, args, port, results):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=20))
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("p", store), rank, 2)
    n = -(-args.tokens // args.page_size)
    cache = torch.randn(args.layers, 2 * n, args.page_size, DIM, device=dev).bfloat16()
    flat = torch.empty(args.layers * n * args.page_size * DIM, dtype=torch.bfloat16, device=dev)
    hello = torch.zeros(
        1, device=dev
    )  # the communicator is built on first use, by both ranks together
    (pg.send([hello], 1, 0) if rank == 0 else pg.recv([hello], 0, 0)).wait()
    torch.cuda.synchronize()
    cases = [("one contiguous send", "flat", 1, False)]
    for runs in args.runs:
        cases.append((f"{runs} run(s) per layer, one group", "views", runs, True))
    cases.append(("1 run per layer, separate sends", "views", 1, False))
    for ci, (name, kind, runs, grouped) in enumerate(cases):
        bufs = [flat] if kind == "flat" else _views(cache, args.layers, n, runs)
        land, post = [], []
        for it in range(3 + args.iters):
            key = f"go/{ci}/{it}"
            # Both ranks post together: a group's first coalesced operation builds a communicator, which
            # blocks until both join.
            torch.cuda.synchronize()
            store.set(f"{key}/ready{rank}", "1")
            store.wait([f"{key}/ready0", f"{key}/ready1"])
            if rank == 1:
                if grouped:
                    pg._start_coalescing()
                    for b in bufs:
                        pg.recv([b], 0, 1)
                    works = [pg._end_coalescing()]
                else:
                    works = [pg.recv([b], 0, 1) for b in bufs]
                while not works[-1].is_completed():
                    pass
                t1 = time.monotonic()
                store.set(key + "/t1", repr(t1))
            else:
                t0 = time.monotonic()
                if grouped:
                    pg._start_coalescing()
                    for b in bufs:
                        pg.send([b], 1, 1)
                    works = [pg._end_coalescing()]
                else:
                    works = [pg.send([b], 1, 1) for b in bufs]
                t_post = time.monotonic()
                works[-1].wait()
                torch.cuda.synchronize()
                t1 = float(store.get(key + "/t1"))
                if it >= 3:
                    land.append(t1 - t0)
                    post.append(t_post - t0)
        if rank == 0:
            results[name] = (statistics.median(land), statistics.median(post), len(bufs))
    results["bytes"] = flat.numel() * 2
    store.set(f"done{rank}", "1")
    store.wait(["done0", "done1"])
    time.sleep(1)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--runs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    args = p.parse_args()
    port = _port()
    with mp.Manager() as m:
        results = m.dict()
        mp.spawn(_run, args=(args, port, results), nprocs=2, join=True)
        r = dict(results)
    gb = r.pop("bytes") / 1e9
    env = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("NCCL_"))
    print(f"\n{torch.cuda.get_device_name(0)} x2 | {gb * 1e3 / 1.048576 / 1e3:.1f} MiB | {env}")
    print("| case | sends | ms (posted -> received) | GB/s | P host ms to post |")
    print("|---|---|---|---|---|")
    for name, (t, post, count) in r.items():
        print(f"| {name} | {count} | {1e3 * t:.3f} | {gb / t:.0f} | {1e3 * post:.3f} |")


if __name__ == "__main__":
    main()
