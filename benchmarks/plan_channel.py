"""Driver -> ranks -> driver overhead of one step (`pdserve.engine.RankGroup.step`): encode the plan, broadcast
it, every rank decodes it and replies, the driver gathers and decodes the replies. The handlers run no model, so
the figure is the plan channel's cost per step.

Formats: 'engine' is the engine's own path, as a worker of several ranks runs it (`Worker._run_round`,
`RankRunner`): the driver turns a `StepPlan` of decode rows, made afresh each step as the scheduler makes them,
into wire values (`plan_to_wire` with the worker's `PageTableCache`), each rank reads it (`plan_from_wire`)
and answers a `RankResult` of one token per row of its own (`result_to_wire`), and the driver reads those
(`result_from_wire`); the rank reads its tokens from the wire's arrays. 'engine-rows' is the same, the rank also
making its rows' objects, as `ModelRunner` reads them today. Per rank `--requests` decode rows, each with a
`--context`-token context in `--page-size`-token pages (one position further each step, a new page when one
fills); `--layouts` dp: each rank its own rows; tp: every rank the same rows. 'lists' and 'arrays' are the raw
transport floor: a dict of the same fields for `--requests` requests, as msgpack lists of ints or as int32
buffers, broadcast to every rank, whose handler only counts the requests.

Ranks are local processes on this host (CPU, gloo group); both channels, shared memory ('shm') and gloo ('dist').
Prints, per case, the message bytes, the median of the driver's encoding alone ('engine' formats) and median and
p99 microseconds of the whole step, over `--steps` steps after a warm-up.

    python benchmarks/plan_channel.py [--ranks 2,4] [--channels shm,dist] [--formats engine,engine-rows,lists,arrays]
        [--layouts dp,tp] [--requests 64,128] [--context 4096] [--page-size 64] [--steps 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pdserve.engine.ranks.channel import encode  # noqa: E402
from pdserve.engine.ranks.group import RankGroup, RankGroupConfig  # noqa: E402
from pdserve.engine.ranks.process import HandlerSpec  # noqa: E402
from pdserve.engine.ranks.wire import (  # noqa: E402
    PageTableCache,
    plan_from_wire,
    plan_to_wire,
    result_from_wire,
    result_to_wire,
)
from pdserve.engine.step import DecodeRow, RankResult, RankStep, SampleSpec, StepPlan  # noqa: E402

ENGINE_FORMATS = ("engine", "engine-rows")
RAW_FORMATS = ("lists", "arrays")


def count_requests(ctx):
    """A rank's handler for the raw formats: the number of requests in the plan, checked against the plan's
    own count."""

    def handle(plan):
        n = len(plan["request_ids"]) if plan["format"] == "lists" else len(plan["request_ids"]) // 4
        if n != plan["num_requests"]:
            raise ValueError(
                f"rank {ctx.rank} decoded {n} requests, the plan says {plan['num_requests']}"
            )
        return n

    return handle


def engine_rank(ctx, make_rows: bool):
    """A rank's handler for the engine formats: `RankRunner`'s round without the model. Answers each of its
    decode rows with the row's token id + 1 (so the driver can check that replies stay in row order)."""

    def handle(wire):
        plan_wire, _control = wire
        plan = plan_from_wire(plan_wire)
        rows = plan.ranks[ctx.rank].decode
        if not rows:
            tokens = []
        elif make_rows:
            tokens = [r.token_id + 1 for r in rows]
        else:
            tokens = (rows.token_ids + 1).tolist()
        return [result_to_wire(RankResult(plan.step_id, [], tokens)), []]

    return handle


def make_raw_plan(num_requests: int, context: int, page_size: int, fmt: str, step: int) -> dict:
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


class DecodeBatches:
    """Each rank's running requests as a decode scheduler holds them, in a steady state of contexts around
    `context` tokens: every step each request's position moves on by one and its page list grows by a page when
    the last one fills; a request that reaches `context + page_size / 2` tokens finishes and a new one of
    `context - page_size / 2` (new id, other pages) takes its place, so each step about one request in
    page_size grows a page and one is new. `plan()` makes the step's `StepPlan` afresh (new rows, page lists
    copied), as `Scheduler.schedule` does."""

    def __init__(self, world: int, layout: str, requests: int, context: int, page_size: int):
        rng = np.random.default_rng(0)
        self.world, self.layout, self.page_size = world, layout, page_size
        batches = world if layout == "dp" else 1
        self.first = context - page_size // 2
        self.end = self.first + page_size
        self.positions = [
            [self.first + i % page_size for i in range(requests)] for _ in range(batches)
        ]
        self.generation = [[0] * requests for _ in range(batches)]
        pages_per_slot = self.end // page_size + 1
        # two page sets a request slot, used by turns, so that a new request has other pages
        spare = rng.permutation(batches * requests * 2 * pages_per_slot).reshape(
            batches, requests, 2, -1
        )
        self.slot_pages = spare.tolist()
        self.num_pages = spare.size
        self.step = 0

    def plan(self) -> StepPlan:
        self.step += 1
        steps = []
        for b, positions in enumerate(self.positions):
            rows = []
            for i in range(len(positions)):
                positions[i] += 1
                if positions[i] == self.end:  # finished: a new request takes the slot
                    positions[i] = self.first
                    self.generation[b][i] += 1
                generation = self.generation[b][i]
                pages = self.slot_pages[b][i][generation % 2][: positions[i] // self.page_size + 1]
                sample = SampleSpec(0.0, 1.0, -1, 0.0, i, self.step)
                rows.append(
                    DecodeRow(f"{b}-{i}-{generation}", (i * 7919 + self.step) % 129_280,
                              positions[i], pages, sample)
                )  # fmt: skip
            steps.append(RankStep(decode=rows))
        return StepPlan(self.step, steps if self.layout == "dp" else steps * self.world)


def measure_engine(world: int, channel: str, fmt: str, layout: str, requests: int, args):
    """(message bytes, median encode us, median us, p99 us) of `args.steps` steps of the engine's path."""
    batches = DecodeBatches(world, layout, requests, args.context, args.page_size)
    config = RankGroupConfig(world, channel=channel, join_timeout_s=120, step_timeout_s=30)
    handler = HandlerSpec("plan_channel:engine_rank", {"make_rows": fmt == "engine-rows"})
    cache = PageTableCache(batches.num_pages)
    encode_times, times, size = [], [], 0
    with RankGroup(config, handler) as group:
        for step in range(args.warmup + args.steps):
            plan = batches.plan()
            start = time.perf_counter()
            wire = plan_to_wire(plan, cache)
            encoded = time.perf_counter()
            replies = group.step([wire, None])
            results = [result_from_wire(reply[0]) for reply in replies]
            elapsed = time.perf_counter() - start
            for rank, result in enumerate(results):
                want = [r.token_id + 1 for r in plan.ranks[rank].decode]
                if result.step_id != plan.step_id or result.decode_tokens != want:
                    raise RuntimeError(f"step {step}: rank {rank} answered {result}")
            if step >= args.warmup:
                encode_times.append((encoded - start) * 1e6)
                times.append(elapsed * 1e6)
        size = len(encode([wire, None]))
    times.sort()
    return size, statistics.median(encode_times), statistics.median(times), p99(times)


def measure_raw(world: int, channel: str, fmt: str, requests: int, args):
    """(plan bytes, None, median us, p99 us) of `args.steps` steps of a raw-format plan."""
    plans = [make_raw_plan(requests, args.context, args.page_size, fmt, s) for s in range(8)]
    config = RankGroupConfig(world, channel=channel, join_timeout_s=120, step_timeout_s=30)
    times = []
    with RankGroup(config, HandlerSpec("plan_channel:count_requests")) as group:
        for step in range(args.warmup + args.steps):
            plan = plans[step % len(plans)]
            start = time.perf_counter()
            replies = group.step(plan)
            elapsed = time.perf_counter() - start
            if replies != [requests] * world:
                raise RuntimeError(f"step {step}: replies {replies}")
            if step >= args.warmup:
                times.append(elapsed * 1e6)
    times.sort()
    return len(encode(plans[0])), None, statistics.median(times), p99(times)


def p99(sorted_times: list[float]) -> float:
    return sorted_times[int(0.99 * (len(sorted_times) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--channels", default="shm,dist")
    parser.add_argument("--formats", default="engine,engine-rows,lists,arrays")
    parser.add_argument("--layouts", default="dp,tp", help="the engine formats' row layouts")
    parser.add_argument(
        "--requests", default="64,128", help="decode rows per rank, comma-separated"
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=64)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; decode rows of context {args.context}, page size "
          f"{args.page_size}; {args.steps} steps")  # fmt: skip
    print(f"{'ranks':>5} {'channel':>7} {'format':>11} {'layout':>6} {'requests':>8} "
          f"{'bytes':>8} {'encode us':>9} {'median us':>9} {'p99 us':>8}")  # fmt: skip
    for world in (int(w) for w in args.ranks.split(",")):
        for channel in args.channels.split(","):
            for fmt in args.formats.split(","):
                if fmt not in ENGINE_FORMATS + RAW_FORMATS:
                    parser.error(f"unknown format {fmt!r}")
                layouts = args.layouts.split(",") if fmt in ENGINE_FORMATS else ["-"]
                for layout in layouts:
                    for requests in (int(r) for r in args.requests.split(",")):
                        if fmt in ENGINE_FORMATS:
                            got = measure_engine(world, channel, fmt, layout, requests, args)
                        else:
                            got = measure_raw(world, channel, fmt, requests, args)
                        size, encode_us, median, worst = got
                        encoding = "-" if encode_us is None else f"{encode_us:.1f}"
                        print(f"{world:>5} {channel:>7} {fmt:>11} {layout:>6} {requests:>8} {size:>8} "
                              f"{encoding:>9} {median:>9.1f} {worst:>8.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
