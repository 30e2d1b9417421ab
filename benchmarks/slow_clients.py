"""Slow clients are cut within the documented timeouts, and the server's other clients do not notice.

    python benchmarks/slow_clients.py --clients 1000 --header-timeout-s 5 --body-timeout-s 5

Starts `pdserve serve` (the tiny model on the CPU, one decode worker) with router.http_header_timeout_s and
router.http_body_timeout_s as given, and --watchers ordinary streaming clients. After a baseline of --baseline-s
seconds, opens --clients connections (a few ms apart): half trickle their request's headers, half send
their headers and trickle the body, one byte every --trickle-s seconds, until the server closes the
connection. Each slow client's time from connecting to being closed is its cut time; the header tricklers'
bound is the header timeout, the body tricklers' the body timeout (their headers arrive at once). Prints the
cut times against their bound, how many got the 408 answer, the watchers' chunk gaps and times to a first
chunk in the baseline and during the attack (the slow clients run in a process of their own), and the server
log's ERROR lines and tracebacks; writes $OUT/slow_clients.json when OUT is set."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import resource
import time
from pathlib import Path

import numpy as np
from _serve import Served, Watchers

_REQUEST = b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"


async def slow_client(port: int, kind: str, trickle_s: float, give_up_s: float) -> dict:
    """One connection trickling its `kind` ("headers" or "body") until the server closes it."""
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        return {"kind": kind, "error": f"connect: {e}"}
    if kind == "headers":
        writer.write(_REQUEST)
        piece = b"x-slow: 1\r\n"
    else:
        writer.write(_REQUEST + b"content-length: 100000\r\n\r\n{")
        piece = b" "
    answer = b""
    read = asyncio.ensure_future(reader.read(1 << 16))
    try:
        while time.monotonic() - start < give_up_s:
            done, _ = await asyncio.wait({read}, timeout=trickle_s)
            if done:
                data = read.result()
                if not data:
                    break  # closed by the server
                answer += data
                read = asyncio.ensure_future(reader.read(1 << 16))
                continue
            writer.write(piece)
        else:
            return {"kind": kind, "error": "never cut", "cut_s": None}
    except OSError:
        pass  # a reset also cuts it
    finally:
        read.cancel()
        writer.close()
    return {
        "kind": kind,
        "cut_s": time.monotonic() - start,
        "got_408": answer.startswith(b"HTTP/1.1 408"),
    }


async def _attack(args, port: int) -> list[dict]:
    give_up = max(args.header_timeout_s, args.body_timeout_s) * 3 + 30
    tasks = []
    for i in range(args.clients):
        kind = "headers" if i % 2 == 0 else "body"
        tasks.append(asyncio.create_task(slow_client(port, kind, args.trickle_s, give_up)))
        await asyncio.sleep(args.open_interval_s)
    return await asyncio.gather(*tasks)


def attack(args, port: int) -> list[dict]:
    """The slow clients, run in a process of their own: the watchers' loop times only the server."""
    return asyncio.run(_attack(args, port))


def cut_summary(results: list[dict], kind: str, bound_s: float) -> dict:
    mine = [r for r in results if r["kind"] == kind]
    cut = np.array([r["cut_s"] for r in mine if r.get("cut_s") is not None])
    return {
        "clients": len(mine),
        "cut": int(len(cut)),
        "bound_s": bound_s,
        "cut_s_p50": round(float(np.percentile(cut, 50)), 2) if len(cut) else None,
        "cut_s_max": round(float(cut.max()), 2) if len(cut) else None,
        "past_bound_plus_1s": int((cut > bound_s + 1).sum()),
        "got_408": sum(bool(r.get("got_408")) for r in mine),
        "errors": sorted({r["error"] for r in mine if "error" in r})[:5],
    }


async def run(args) -> dict:
    flags = [
        "--router.http-header-timeout-s", str(args.header_timeout_s),
        "--router.http-body-timeout-s", str(args.body_timeout_s),
    ]  # fmt: skip
    served = Served(args.model, Path(args.log), flags)
    try:
        watchers = Watchers(served.http_url, args.watchers, args.max_tokens)
        watchers.start()
        base_start = time.monotonic()
        await asyncio.sleep(args.baseline_s)
        base_end = time.monotonic()
        with concurrent.futures.ProcessPoolExecutor(1) as pool:
            start = time.monotonic()
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(pool, attack, args, served.http_port)
            end = time.monotonic()
        await watchers.stop()
        return {
            "clients": args.clients,
            "header_trickle": cut_summary(results, "headers", args.header_timeout_s),
            "body_trickle": cut_summary(results, "body", args.body_timeout_s),
            "attack_s": round(end - start, 1),
            "watchers_baseline": watchers.summary(base_start, base_end),
            "watchers_during_attack": watchers.summary(start, end),
            "watcher_errors": watchers.errors[:5],
            "server_log": served.log_faults(),
        }
    finally:
        served.stop()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--clients", type=int, default=1000, help="slow connections")
    p.add_argument("--header-timeout-s", type=float, default=5.0)
    p.add_argument("--body-timeout-s", type=float, default=5.0)
    p.add_argument(
        "--trickle-s", type=float, default=1.0, help="seconds between a slow client's bytes"
    )
    p.add_argument(
        "--open-interval-s", type=float, default=0.002, help="between two slow connections"
    )
    p.add_argument("--watchers", type=int, default=4, help="ordinary streaming clients")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per watcher request")
    p.add_argument("--baseline-s", type=float, default=10.0, help="watchers alone first")
    p.add_argument("--model", default="tiny")
    p.add_argument("--log", default="/tmp/pdserve-slow-clients-serve.log", help="the server's log")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * args.clients + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2 * args.clients + 256), hard))
    summary = asyncio.run(run(args))
    print(json.dumps(summary, indent=2))
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "slow_clients.json"
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
