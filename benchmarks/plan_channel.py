"""Driver -> ranks -> driver overhead of one step (`pdserve.engine.RankGroup.step`): msgpack-encode the plan,
broadcast it, every rank decodes it and replies, the driver gathers and decodes the replies. The handler does
nothing but count the plan's requests, so the figure is the plan channel's cost per step.

The plan is a decode step of `--requests` requests (default 128), each with its token id, position and the page
ids of a `--context`-token context in `--page-size`-token pages, as msgpack lists of ints ('lists') or as raw
int32 buffers ('arrays'). Ranks are local processes on this host (CPU, gloo group); both channels, shared memory
('shm') and gloo ('dist'). Prints median and p99 microseconds per step over `--steps` steps after a warm-up.

    python benchmarks/plan_channel.py [--ranks 2,4] [--steps 2000] [--requests 128] [--context 4096]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pdserve.engine.plan_channel import encode  # noqa: E402
from pdserve.engine.rank_group import RankGroup, RankGroupConfig  # noqa: E402
from pdserve.engine.rank_process import HandlerSpec  # noqa: E402

HANDLER = HandlerSpec("plan_channel:count_requests")


def count_requests(ctx):
    """A rank's handler: the number of requests in the plan, checked against the plan's own count."""

    def handle(plan):
        n = len(plan["request_ids"]) if plan["format"] == "lists" else len(plan["request_ids"]) // 4
        if n != plan["num_requests"]:
            raise ValueError(
                f"rank {ctx.rank} decoded {n} requests, the plan says {plan['num_requests']}"
            )
        return n

    return handle


def make_plan(num_requests: int, context: int, page_size: int, fmt: str, step: int) -> dict:
    rng = np.random.default_rng(step)
    pages_per_request = -(-context // page_size)
    request_ids = np.arange(num_requests, dtype=np.int32)
    token_ids = rng.integers(0, 129_280, num_requests, dtype=np.int32)
    positions = np.full(num_requests, context - 1, dtype=np.int32)
    page_ids = rng.integers(0, 1 << 20, (num_requests, pages_per_request), dtype=np.int32)
    plan = {"step": step, "decode": True, "format": fmt, "num_requests": num_requests}
    if fmt == "lists":
        plan |= {
            "request_ids": request_ids.tolist(), "token_ids": token_ids.tolist(),
            "positions": positions.tolist(), "page_ids": page_ids.tolist(),
        }  # fmt: skip
    else:
        plan |= {
            "request_ids": request_ids.tobytes(), "token_ids": token_ids.tobytes(),
            "positions": positions.tobytes(), "page_ids": page_ids.tobytes(),
            "pages_per_request": pages_per_request,
        }  # fmt: skip
    return plan


def measure(world: int, channel: str, fmt: str, args) -> tuple[int, float, float]:
    """(plan bytes, median us, p99 us) of `args.steps` steps."""
    plans = [make_plan(args.requests, args.context, args.page_size, fmt, s) for s in range(8)]
    config = RankGroupConfig(world, channel=channel, join_timeout_s=120, step_timeout_s=30)
    times = []
    with RankGroup(config, HANDLER) as group:
        for step in range(args.warmup + args.steps):
            plan = plans[step % len(plans)]
            start = time.perf_counter()
            replies = group.step(plan)
            elapsed = time.perf_counter() - start
            if replies != [args.requests] * world:
                raise RuntimeError(f"step {step}: replies {replies}")
            if step >= args.warmup:
                times.append(elapsed * 1e6)
    times.sort()
    return len(encode(plans[0])), statistics.median(times), times[int(0.99 * (len(times) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--channels", default="shm,dist")
    parser.add_argument("--formats", default="lists,arrays")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=64)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; plan: {args.requests} requests, context {args.context}, "
          f"page size {args.page_size}; {args.steps} steps")  # fmt: skip
    print(
        f"{'ranks':>5} {'channel':>7} {'format':>6} {'plan bytes':>10} {'median us':>10} {'p99 us':>9}"
    )
    for world in (int(w) for w in args.ranks.split(",")):
        for channel in args.channels.split(","):
            for fmt in args.formats.split(","):
                size, median, p99 = measure(world, channel, fmt, args)
                print(f"{world:>5} {channel:>7} {fmt:>6} {size:>10} {median:>10.1f} {p99:>9.1f}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
