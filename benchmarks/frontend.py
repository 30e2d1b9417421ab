"""Front-end throughput: tokens streamed per second through the OpenAI HTTP API and through gRPC, and the latency
each front end adds per chunk, against a decode side that emits at a fixed rate without a model (the benchmark-only
`cluster.benchmark_fake_decode_ms`: every interval each running request gets --tokens-per-tick tokens of one
symbol that names the tick).

    python benchmarks/frontend.py --interval-ms 20 --tokens-per-tick 1 --streams 200,400,800 --seconds 6

Starts `pdserve serve` (the tiny model's tokenizer, no prefill worker, one fake decode worker) in a child process,
then for each protocol and each --streams count opens that many streams at once, each asking for --seconds worth
of ticks, and times every chunk on arrival. The decode side emits tick n at n * interval on the node's monotonic
clock with symbol n mod 62, so a chunk's emission time is the latest grid time before its arrival with its first
token's symbol: added latency = arrival - emission (it includes this client's own reading of the socket, and the
decode worker waking late). Throughput counts tokens received while every stream was open (from the last
stream's first chunk to the first stream's end). Offered: streams x tokens-per-tick / interval. The serving
process's CPU time per chunk (router and front ends; the decode actor is another process) is the figure least
moved by other load on the machine. Prints one line per (protocol, streams) and writes $OUT/frontend.json when
OUT is set. --profile DIR runs the server under cProfile and writes its stats there when it stops. --floor runs
the same load against a server of the same stack with nothing behind it (`_frontend_floor.py`): the most a Python
front end gets from this machine and this client."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from _sse import HttpStatusError, post_events

from pdserve.cli.client import generate_request
from pdserve.cluster.fixed_rate_decode import SYMBOLS
from pdserve.v1 import generation_pb2_grpc

_TEXT = re.compile(rb'"text":"([0-9a-zA-Z]*)"')
_SYMBOL_INDEX = {ord(c): i for i, c in enumerate(SYMBOLS)}
_SERVE_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stream:
    """One stream's chunks: (arrival time.monotonic(), the index of its first token's symbol, tokens)."""

    __slots__ = ("chunks", "error")

    def __init__(self):
        self.chunks: list[tuple[float, int, int]] = []
        self.error = ""


async def http_stream(port: int, max_tokens: int) -> Stream:
    out = Stream()
    body = {"prompt": [0, 5, 6], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    try:
        async for now, payloads in post_events(f"http://127.0.0.1:{port}/v1", "/completions", body):
            for payload in payloads:
                match = _TEXT.search(payload)
                if match and match.group(1):
                    text = match.group(1)
                    out.chunks.append((now, _SYMBOL_INDEX[text[0]], len(text)))
    except (HttpStatusError, OSError) as e:
        out.error = str(e)
    return out


async def grpc_stream(stub, max_tokens: int) -> Stream:
    out = Stream()
    request = generate_request([0, 5, 6], max_tokens=max_tokens, ignore_eos=True)
    try:
        async for chunk in stub.Generate(request, timeout=600):
            now = time.monotonic()
            if chunk.text:
                out.chunks.append((now, _SYMBOL_INDEX[ord(chunk.text[0])], len(chunk.token_ids)))
    except grpc.aio.AioRpcError as e:
        out.error = f"{e.code().name}: {e.details()}"
    return out


def added_latency_ms(streams: list[Stream], interval_s: float) -> np.ndarray:
    """Each chunk's arrival minus its first token's emission time (the latest grid tick before arrival with
    its symbol)."""
    arrival = np.array([a for s in streams for a, _, _ in s.chunks])
    symbol = np.array([d for s in streams for _, d, _ in s.chunks])
    tick = np.floor(arrival / interval_s).astype(np.int64)
    tick -= (tick - symbol) % len(SYMBOLS)
    return (arrival - tick * interval_s) * 1e3


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(
    protocol: str, streams: list[Stream], args, num_streams: int, wall: float, cpu_s: float,
    start: float,
) -> dict:  # fmt: skip
    ok = [s for s in streams if not s.error and s.chunks]
    if not ok:
        sys.exit(f"{protocol}: every stream failed; the first: {streams[0].error or 'no chunks'}")
    begin = max(s.chunks[0][0] for s in ok)
    end = min(s.chunks[-1][0] for s in ok)
    window = [n for s in ok for a, _, n in s.chunks if begin < a <= end]
    latency = added_latency_ms(ok, args.interval_ms / 1e3)
    num_chunks = sum(len(s.chunks) for s in ok)
    num_tokens = sum(n for s in ok for _, _, n in s.chunks)
    return {
        "protocol": protocol,
        "streams": num_streams,
        "interval_ms": args.interval_ms,
        "tokens_per_tick": args.tokens_per_tick,
        "offered_tokens_per_s": num_streams * args.tokens_per_tick / (args.interval_ms / 1e3),
        "tokens_per_s": sum(window) / (end - begin) if end > begin else 0.0,
        "chunks_per_s": len(window) / (end - begin) if end > begin else 0.0,
        "added_ms_p50": float(np.percentile(latency, 50)),
        "added_ms_p99": float(np.percentile(latency, 99)),
        "added_ms_max": float(latency.max()),
        "all_open_s": end - begin,
        "last_first_chunk_s": begin - start,
        "tokens": num_tokens,
        "chunks": num_chunks,
        "server_cpu_s": cpu_s,
        "server_cpu_us_per_chunk": 1e6 * cpu_s / num_chunks,
        "server_cpu_us_per_token": 1e6 * cpu_s / num_tokens,
        "errors": len(streams) - len(ok),
        "first_error": next((s.error for s in streams if s.error), None),
        "wall_s": wall,
    }


async def run_load(protocol: str, num_streams: int, args, ports: dict, pid: int) -> dict:
    max_tokens = int(args.seconds * 1e3 / args.interval_ms) * args.tokens_per_tick
    cpu_before, start = cpu_seconds(pid), time.monotonic()
    if protocol == "http":
        streams = await asyncio.gather(
            *(http_stream(ports["http"], max_tokens) for _ in range(num_streams))
        )
    else:
        options = [("grpc.max_concurrent_streams", 1 << 16)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['grpc']}", options) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            streams = await asyncio.gather(
                *(grpc_stream(stub, max_tokens) for _ in range(num_streams))
            )
    wall, cpu_s = time.monotonic() - start, cpu_seconds(pid) - cpu_before
    return summarize(protocol, streams, args, num_streams, wall, cpu_s, start)


def start_server(args, ports: dict) -> subprocess.Popen:
    command = [sys.executable]
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        command += ["-m", "cProfile", "-o", str(Path(args.profile) / "serve.prof")]
    if args.floor:
        command += [
            str(Path(__file__).with_name("_frontend_floor.py")), "--grpc-port", str(ports["grpc"]),
            "--http-port", str(ports["http"]), "--interval-ms", str(args.interval_ms),
            "--tokens-per-tick", str(args.tokens_per_tick),
        ]  # fmt: skip
    else:
        command += [
            "-m", "pdserve.cli.main", "serve", "--model", args.model, "--prefill", "0",
            "--decode", "1", "--port", str(ports["grpc"]), "--http-port", str(ports["http"]),
            "--cluster.cpus-per-worker", "0.5",
            "--cluster.benchmark-fake-decode-ms", str(args.interval_ms),
            "--cluster.benchmark-fake-decode-tokens", str(args.tokens_per_tick),
            "--router.max-queued-requests", "65536", "--router.stats-interval-s", "0",
        ]  # fmt: skip
    log = open(args.log, "w")  # noqa: SIM115 (the child writes it until stop)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    give_up = time.monotonic() + _SERVE_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/health", timeout=2):
                return server
        except OSError:
            if server.poll() is not None or time.monotonic() > give_up:
                server.kill()
                sys.exit(f"pdserve serve did not come up; see {args.log}")
            time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--interval-ms", type=float, default=20.0, help="the fake decode step")
    p.add_argument("--tokens-per-tick", type=int, default=1, help="tokens per request per step")
    p.add_argument("--streams", default="100,200,400", help="comma-separated stream counts")
    p.add_argument("--seconds", type=float, default=6.0, help="how long each stream lasts")
    p.add_argument("--protocols", default="http,grpc")
    p.add_argument(
        "--model", default="tiny", help="whose tokenizer (one token per digit and letter)"
    )
    p.add_argument("--log", default="/tmp/pdserve-frontend-serve.log", help="the server's log")
    p.add_argument("--profile", default=None, help="run the server under cProfile, stats here")
    p.add_argument(
        "--floor", action="store_true",
        help="measure the floor instead: benchmarks/_frontend_floor.py streams the same chunks on the same "
        "grid from Starlette/uvicorn and grpc.aio with no router, Ray or engine behind them",
    )  # fmt: skip
    args = p.parse_args()
    counts = [int(x) for x in args.streams.split(",")]
    protocols = args.protocols.split(",")
    if bad := set(protocols) - {"http", "grpc"}:
        p.error(f"--protocols: unknown {', '.join(sorted(bad))} (http, grpc)")
    ports = {"grpc": free_port(), "http": free_port()}
    server = start_server(args, ports)
    summaries = []
    try:
        for protocol in protocols:
            for n in counts:
                summary = asyncio.run(run_load(protocol, n, args, ports, server.pid))
                summaries.append(summary)
                print(
                    f"{protocol:>4} {n:5d} streams: {summary['tokens_per_s']:9.0f} tok/s "
                    f"({summary['chunks_per_s']:8.0f} chunks/s; offered "
                    f"{summary['offered_tokens_per_s']:.0f}), added per chunk p50 "
                    f"{summary['added_ms_p50']:.2f} ms p99 {summary['added_ms_p99']:.2f} ms, "
                    f"server CPU {summary['server_cpu_us_per_chunk']:.0f} us/chunk, "
                    f"errors {summary['errors']}",
                    flush=True,
                )
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "frontend.json"
        path.write_text(json.dumps(summaries, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
