"""Slow clients are cut within the documented timeouts, and the server's other clients do not notice.

    python benchmarks/slow_clients.py --clients 1000 --header-timeout-s 5 --body-timeout-s 5

Starts `pdserve serve` (the tiny model on the CPU, one decode worker) with router.http_header_timeout_s and
router.http_body_timeout_s as given, and --watchers ordinary streaming clients. After a baseline of --baseline-s
seconds, opens --clients connections (a few ms apart), of four kinds in turn (--protocol both; http or grpc
takes two): over HTTP/1.1, one trickles its request's headers, one sends its headers and trickles the body;
over gRPC (HTTP/2), one trickles the connection preface, one sends a Generate call's headers and trickles its
request message. Each sends a byte every --trickle-s seconds until the server ends the connection (or the
call); the gRPC ones acknowledge the server's SETTINGS and pings, as a live client does, so keepalive alone
cannot cut them. Each slow client's time from connecting to being cut is its cut time; the header and
preface tricklers' bound is the header timeout, the body and message tricklers' the body timeout. Prints the
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


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_GENERATE = "/pdserve.v1.Generation/Generate"


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame."""
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def _grpc_headers(port: int) -> bytes:
    """A Generate call's request headers, HPACK literals without indexing (no table to keep)."""

    def literal(name: bytes, value: bytes) -> bytes:
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

    fields = [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", _GENERATE.encode()),
        (b":authority", f"127.0.0.1:{port}".encode()), (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]  # fmt: skip
    return b"".join(literal(n, v) for n, v in fields)


async def _h2_reader(reader, writer, acking: asyncio.Event, ended: list) -> None:
    """Reads the server's frames as a well-behaved client does: acknowledges SETTINGS and PINGs (once its
    own preface is out, `acking`), so that keepalive never cuts it; records a GOAWAY, a RST_STREAM or the
    connection's close in `ended`."""
    buf = b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            ended.append("closed")
            return
        buf += data
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            size = int.from_bytes(buf[:3], "big")
            kind, flags, payload, buf = buf[3], buf[4], buf[9 : 9 + size], buf[9 + size :]
            if kind in (3, 7):  # RST_STREAM, GOAWAY
                ended.append("rst_stream" if kind == 3 else "goaway")
            elif acking.is_set() and kind in (4, 6) and not flags & 1:  # SETTINGS, PING: ack
                writer.write(_frame(kind, 1, 0, payload if kind == 6 else b""))


async def slow_grpc_client(port: int, kind: str, trickle_s: float, give_up_s: float) -> dict:
    """One gRPC connection: "grpc-handshake" trickles the HTTP/2 preface a byte at a time; "grpc-message"
    sends the preface and a Generate call's headers at once, then its request message a byte at a time.
    Either keeps going until the server ends the connection or the call."""
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        return {"kind": kind, "error": f"connect: {e}"}
    acking, ended = asyncio.Event(), []
    read = asyncio.ensure_future(_h2_reader(reader, writer, acking, ended))
    try:
        if kind == "grpc-handshake":
            pieces = [bytes([b]) for b in _PREFACE]
        else:
            writer.write(_PREFACE + _frame(4, 0, 0))
            acking.set()
            writer.write(_frame(1, 4, 1, _grpc_headers(port)))  # HEADERS, END_HEADERS
            pieces = []
            writer.write(
                _frame(0, 0, 1, b"\x00" + (1000).to_bytes(4, "big"))
            )  # a 1000-byte message
        while not ended and not read.done() and time.monotonic() - start < give_up_s:
            await asyncio.sleep(trickle_s)
            if pieces:
                writer.write(pieces.pop(0))
                if not pieces:
                    acking.set()
                    writer.write(_frame(4, 0, 0))
            elif kind == "grpc-message":
                writer.write(_frame(0, 0, 1, b"\x0a"))
        if not ended and not read.done():
            return {"kind": kind, "error": "never cut", "cut_s": None}
    except OSError:
        pass  # a reset also cuts it
    finally:
        read.cancel()
        writer.close()
    return {
        "kind": kind,
        "cut_s": time.monotonic() - start,
        "ended_by": ended[0] if ended else "reset",
    }


def _kinds(protocol: str) -> list[str]:
    http, grpc = ["headers", "body"], ["grpc-handshake", "grpc-message"]
    return {"http": http, "grpc": grpc, "both": http + grpc}[protocol]


async def _attack(args, ports: dict[str, int]) -> list[dict]:
    give_up = max(args.header_timeout_s, args.body_timeout_s) * 3 + 30
    kinds = _kinds(args.protocol)
    tasks = []
    for i in range(args.clients):
        kind = kinds[i % len(kinds)]
        if kind.startswith("grpc"):
            client = slow_grpc_client(ports["grpc"], kind, args.trickle_s, give_up)
        else:
            client = slow_client(ports["http"], kind, args.trickle_s, give_up)
        tasks.append(asyncio.create_task(client))
        await asyncio.sleep(args.open_interval_s)
    return await asyncio.gather(*tasks)


def attack(args, ports: dict[str, int]) -> list[dict]:
    """The slow clients, run in a process of their own: the watchers' loop times only the server."""
    return asyncio.run(_attack(args, ports))


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
        "ended_by": sorted({r["ended_by"] for r in mine if "ended_by" in r}),
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
            ports = {"http": served.http_port, "grpc": served.grpc_port}
            results = await loop.run_in_executor(pool, attack, args, ports)
            end = time.monotonic()
        await watchers.stop()
        bounds = {
            "headers": args.header_timeout_s, "body": args.body_timeout_s,
            "grpc-handshake": args.header_timeout_s, "grpc-message": args.body_timeout_s,
        }  # fmt: skip
        return {
            "clients": args.clients,
            **{kind: cut_summary(results, kind, bounds[kind]) for kind in _kinds(args.protocol)},
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
    p.add_argument(
        "--protocol", choices=["http", "grpc", "both"], default="both",
        help="which doors the slow clients knock on (their kinds taken in turn)",
    )  # fmt: skip
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
