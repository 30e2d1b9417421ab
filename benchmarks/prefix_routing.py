"""Prefix-aware routing against load-only routing, and decode-side KV reuse on and off: a multi-turn chat load
served by `pdserve serve` (started here, once per policy, in a child process) over gRPC, with the prefix cache's
hit rate, TTFT p50/p99 and the KV pages the prefill workers sent and did not send per policy.

    python benchmarks/prefix_routing.py [--model tiny] [--decode 2 --prefill 0] [--conversations 16] \
        [--turns 6] [--first-len 512] [--turn-len 64] [--output-len 16] [--rate 4]

The load: --conversations conversations, started at Poisson arrivals of --rate a second; each runs --turns turns
one after another, a turn's prompt being the previous turn's prompt, its answer and --turn-len new tokens (the
first turn: --first-len random tokens), so each turn after the first resends a prefix some worker computed. Every
request is greedy with EOS ignored (--output-len tokens each). The same load (same seed) runs against a server
with router.prefix_aware_routing on and one with it off; the workers' prefix caches are on in both. Policy
no_decode_reuse is prefix_aware with decode.reuse_held_prefix off: the decode workers keep no received KV, so
every turn's whole KV travels from its prefill worker (with --prefill 0 there is no transfer to spare).

Reported per policy: hit rate (prompt tokens found cached over prompt tokens, from each response's
usage.cached_tokens) and TTFT p50/p99, over all turns and over the turns after the first (the first turns find
nothing cached under either policy). A turn can find at most the full pages of the previous turn's prompt (a
worker caches the pages its prefill computed), so the later turns' hit rate stays below 1 even where every turn
goes to the right worker. On a small shared machine the server started second can run faster than the first
whatever its policy: compare runs in both orders (--policies). Disaggregated (--prefill >= 1), also reported:
the KV pages and bytes the prefill workers sent, and those not sent because the decode worker held them already
(the server's /metrics after the load: pdserve:kv_transfer_pages and kv_transfer_pages_not_sent, warm-up
included). Always: the pages the workers' host tiers stored and restored (host hits; 0 with the tier off). Writes
$OUT/prefix_routing.json when OUT is set.

Host-tier hits: give the workers a small KV cache and a host tier (e.g. `--flags --decode.num-pages 12
--decode.host-kv-cache-bytes 67108864` on a CPU) so that conversations' earlier turns are evicted to host memory between
turns, and compare `--host-hit-weight 0.75` (the default: the router counts a prefix held in a worker's host tier)
with `--host-hit-weight 0` (it does not: a turn whose whole prefix left the GPU goes by load alone, maybe to a
worker that recomputes it). A prefix's first pages are evicted last, so its holder often keeps a GPU hit that
draws the turn under either weight; the weight decides where the whole prefix left the GPU, or where the loads
differ by more than the GPU part of the hit."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from _serve import Served

from pdserve.cli.client import generate_request
from pdserve.v1 import generation_pb2_grpc


async def one_turn(stub, prompt: list[int], args) -> dict:
    request = generate_request(prompt, max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start, first, tokens, cached = time.perf_counter(), None, [], 0
    async for chunk in stub.Generate(request, timeout=args.timeout):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
        tokens.extend(chunk.token_ids)
        if chunk.HasField("usage"):
            cached = chunk.usage.cached_tokens
    if first is None:
        raise RuntimeError(f"a turn of {len(prompt)} prompt tokens streamed no token")
    return {"prompt": len(prompt), "cached": cached, "ttft_s": first - start, "tokens": tokens}


async def conversation(stub, c: int, start_at: float, args) -> list[dict]:
    rng = random.Random(args.seed * 100_003 + c)
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    prompt = [rng.randrange(3, args.vocab) for _ in range(args.first_len)]
    turns = []
    for t in range(args.turns):
        out = await one_turn(stub, prompt, args)
        out["turn"] = t
        turns.append(out)
        prompt = [
            *prompt,
            *out.pop("tokens"),
            *(rng.randrange(3, args.vocab) for _ in range(args.turn_len)),
        ]
    return turns


async def load(port: int, args) -> list[dict]:
    rng = random.Random(args.seed)
    now, starts = time.perf_counter(), []
    for _ in range(args.conversations):
        now += rng.expovariate(args.rate)
        starts.append(now)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # warm-up: one request per worker's worth, not measured, of prompts no conversation shares
        warm = [[3 + (i % 7)] * args.first_len for i in range(2 * (args.decode + args.prefill))]
        await asyncio.gather(*(one_turn(stub, p, args) for p in warm))
        begin = time.perf_counter()
        starts = [begin + s - starts[0] for s in starts]
        done = await asyncio.gather(*(conversation(stub, c, s, args) for c, s in enumerate(starts)))
    return [turn for turns in done for turn in turns]


def summarize(turns: list[dict]) -> dict:
    def part(rows: list[dict]) -> dict:
        ttft = np.array([r["ttft_s"] for r in rows]) * 1e3
        prompt, cached = sum(r["prompt"] for r in rows), sum(r["cached"] for r in rows)
        return {
            "requests": len(rows),
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1),
        }

    return {"all_turns": part(turns), "later_turns": part([t for t in turns if t["turn"] > 0])}


KV_COUNTERS = {
    "kv_pages_sent": "pdserve:kv_transfer_pages_total",
    "kv_pages_not_sent": "pdserve:kv_transfer_pages_not_sent_total",
    "kv_bytes_sent": "pdserve:kv_transfer_bytes_total",
    "kv_bytes_not_sent": "pdserve:kv_transfer_bytes_not_sent_total",
    "host_kv_offloaded_pages": "pdserve:host_kv_offloaded_pages_total",
    "host_kv_restored_pages": "pdserve:host_kv_restored_pages_total",
}
STATS_WAIT_S = 3.0
"""How long after the load the metrics are read: the server polls its workers' stats about once a second."""


def kv_pages(served: Served) -> dict[str, int]:
    """The workers' KV counters since start (`KV_COUNTERS`), summed over the workers."""
    time.sleep(STATS_WAIT_S)
    url = f"http://127.0.0.1:{served.http_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    totals = dict.fromkeys(KV_COUNTERS, 0)
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        for key, metric in KV_COUNTERS.items():
            if name == metric:
                totals[key] += int(float(rest.rsplit(" ", 1)[1]))
    return totals


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="tiny")
    p.add_argument("--decode", type=int, default=2, help="decode workers")
    p.add_argument(
        "--prefill", type=int, default=0, help="prefill workers (0: decode workers prefill)"
    )
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-len", type=int, default=512, help="first turn's prompt tokens")
    p.add_argument("--turn-len", type=int, default=64, help="new prompt tokens per later turn")
    p.add_argument("--output-len", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--rate", type=float, default=4.0, help="conversations started per second")
    p.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from [3, vocab)")
    p.add_argument("--load-weight", type=float, default=1.0, help="router.prefix_load_weight")
    p.add_argument(
        "--host-hit-weight", type=float, default=0.75, help="router.prefix_host_hit_weight"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="deadline per request, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policies",
        default="prefix_aware,load_only",
        help="which to run, in this order (comma-separated): prefix_aware, load_only, no_decode_reuse",
    )
    p.add_argument(
        "--log", default="/tmp/pdserve-prefix-routing-serve.log", help="the server's log"
    )
    p.add_argument(
        "--flags", nargs=argparse.REMAINDER, default=[], help="more `pdserve serve` flags"
    )
    args = p.parse_args()
    if args.decode < 1 or args.prefill < 0 or args.conversations < 1 or args.turns < 1:
        sys.exit("--decode and --conversations and --turns must be >= 1, --prefill >= 0")
    known = {"prefix_aware", "load_only", "no_decode_reuse"}
    unknown = set(args.policies.split(",")) - known
    if unknown:
        sys.exit(f"--policies: unknown {sorted(unknown)} (expected some of {sorted(known)})")
    summary = {"config": {k: v for k, v in vars(args).items() if k != "log"}}
    for policy in args.policies.split(","):
        on = "false" if policy == "load_only" else "true"
        reuse = "false" if policy == "no_decode_reuse" else "true"
        flags = [
            "--prefill", str(args.prefill), "--decode", str(args.decode),
            "--router.prefix-aware-routing", on, "--router.prefix-load-weight", str(args.load_weight),
            "--router.prefix-host-hit-weight", str(args.host_hit_weight),
            "--decode.reuse-held-prefix", reuse, *args.flags,
        ]  # fmt: skip
        served = Served(args.model, Path(f"{args.log}.{policy}"), flags)
        try:
            turns = asyncio.run(load(served.grpc_port, args))
            kv = kv_pages(served)
        finally:
            served.stop()
        summary[policy] = summarize(turns) | kv
        print(policy, json.dumps(summary[policy]), flush=True)
    print(json.dumps(summary, indent=2))
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "prefix_routing.json"
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
