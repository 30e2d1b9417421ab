"""Malformed requests through both front ends: none may get a 5xx (gRPC: INTERNAL or UNKNOWN), none may leave a
traceback in the log, and the server's other clients must not stall meanwhile.

    python benchmarks/malformed.py --requests 10000 --concurrency 32

Starts `pdserve serve` (the tiny model on the CPU, one decode worker; default max_tokens 4, so that a request
a mutation left valid is short), runs --watchers ordinary streaming clients for a baseline of --baseline-s
seconds, then sends --requests generated malformed requests (seeded: --seed), --grpc-share of them gRPC, from a
process of their own. The HTTP cases: lone surrogates in every string field and key, nesting past the limit,
integers past their field's range or past the digit limit, values of the wrong type, unknown and unsupported
parameters, bodies that are not JSON or not UTF-8, random byte flips of a valid body, bodies over the cap
(declared or sent), and bytes that are not HTTP (garbage request lines, huge headers, conflicting or invalid
lengths and chunk sizes, unknown paths and methods, clients that leave mid-body). The gRPC cases: random bytes,
strings that are not UTF-8, integers and floats past their ranges, empty and oversized fields, Admin calls
with bad arguments. Prints the answers by class, the 4xx bodies that were not OpenAI-shaped, the watchers'
chunk gaps in the baseline and meanwhile, and the server log's ERROR lines and tracebacks; writes
$OUT/malformed.json when OUT is set."""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import json
import os
import random
import re
import time
from pathlib import Path

import grpc
from _serve import Served, Watchers

from pdserve.cli.client import generate_request
from pdserve.v1 import admin_pb2, generation_pb2

LONE = "\ud800"
STRING_FIELDS = ["prompt", "stop", "user", "model", "suffix"]
INT_FIELDS = ["max_tokens", "top_k", "seed", "min_tokens", "n", "logprobs"]
BIG_INTS = [2**31, 2**32, 2**63, 2**64, -(2**63) - 1, -(2**64), 10**30]
WRONG = [{}, [], "x", 1.5, True, None, [1, "a"], {"a": 1}, -1, 0]
_CAP_BYTES = 64 << 20
"""Bigger than any body limit the server may have."""


def _json(body) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate is spelled \ud800


def _http(path: str, body: bytes, method: str = "POST", extra: bytes = b"") -> bytes:
    return (
        b"%s %s HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"%scontent-length: %d\r\n\r\n%s" % (method.encode(), path.encode(), extra, len(body), body)
    )


def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def http_case(rng: random.Random) -> tuple[str, bytes, bool]:
    """(what, the bytes to send, whether the client leaves without reading)."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    kind = rng.randrange(14)
    if kind == 0:
        field = rng.choice(
            [*STRING_FIELDS, "key", "messages.content", "messages.role", "messages.name", "part"]
        )
        body = dict(base)
        if field == "key":
            body[LONE * rng.randint(1, 3)] = 1
        elif field.startswith("messages") or field == "part":
            message = {"role": "user", "content": "hi"}
            if field == "part":
                message["content"] = [{"type": "text", "text": "a" + LONE}]
            else:
                message[field.split(".")[1]] = "x" + LONE + "y"
            body = {"messages": [message]}
            path = "/v1/chat/completions"
        else:
            body[field] = [LONE] if field == "stop" and rng.random() < 0.5 else "q" + LONE
        return f"surrogate:{field}", _http(path, _json(body)), False
    if kind == 1:
        levels = rng.choice([65, 100, 999, 1000, 5000, 100000])
        field = rng.choice(["user", "prompt", "chat_template_kwargs", "stop"])
        raw = _json(base)[:-1] + b', "%s": %s}' % (field.encode(), _nested(levels).encode())
        return f"nesting:{levels}", _http(path, raw), False
    if kind == 2:
        field = rng.choice(INT_FIELDS)
        value = rng.choice(BIG_INTS)
        return f"int:{field}", _http(path, _json({**base, field: value})), False
    if kind == 3:
        digits = rng.choice([4301, 5000, 20000])
        raw = _json(base)[:-1] + b', "seed": %s}' % (b"9" * digits)
        return "int:digits", _http(path, raw), False
    if kind == 4:
        field = rng.choice(
            [*INT_FIELDS, "temperature", "top_p", "stream", "stop", "messages", "prompt",
             "stream_options", "logit_bias", "response_format", "stop_token_ids"]
        )  # fmt: skip
        return f"type:{field}", _http(path, _json({**base, field: rng.choice(WRONG)})), False
    if kind == 5:
        raw = _json(base)[:-1] + b', "temperature": %s}' % rng.choice(
            [b"NaN", b"Infinity", b"-1e999"]
        )
        return "float:non-finite", _http(path, raw), False
    if kind == 6:
        raw = rng.choice(
            [b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe\xfd", b"\xef\xbb\xbf{}", b'{"prompt": "hi"',
             bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))]
        )  # fmt: skip
        return "not-json", _http(path, raw), False
    if kind == 7:
        raw = bytearray(_json({**base, "max_tokens": 2, "temperature": 0.5, "stop": ["x"]}))
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return "flipped", _http(path, bytes(raw)), False
    if kind == 8:
        name = rng.choice(
            ["best_of", "echo", "logit_bias", "tools", "unknown_" + str(rng.random())]
        )
        return (
            f"param:{name}",
            _http(path, _json({**base, name: rng.choice(WRONG[:5]) or 2})),
            False,
        )
    if kind == 9:
        declared = b"POST %s HTTP/1.1\r\nhost: b\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
        return "body:declared-over-cap", declared % (path.encode(), _CAP_BYTES), False
    if kind == 10:
        size = 20 << 20 if rng.random() < 0.1 else 1 << 20
        body = b'{"prompt": "' + b"a" * size + b'"}'
        return f"body:sent-{size >> 20}MiB", _http(path, body), False
    if kind == 11:
        raw = rng.choice(
            [
                b"GARBAGE\r\n\r\n",
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                b"GET /\xff\xfe HTTP/1.1\r\nhost: b\r\n\r\n",
                b"GET / HTTP/1.1\r\nhost: b\r\nx: " + b"y" * 70000 + b"\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nhost: b\r\ncontent-length: abc\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nhost: b\r\ncontent-length: -5\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nhost: b\r\ncontent-length: 5\r\n"
                b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nhost: b\r\ntransfer-encoding: chunked\r\n\r\n"
                b"zz\r\nabc\r\n0\r\n\r\n",
                b"GET /v1/nothing HTTP/1.1\r\nhost: b\r\nconnection: close\r\n\r\n",
                b"DELETE /v1/completions HTTP/1.1\r\nhost: b\r\nconnection: close\r\n\r\n",
                b"GET /v1/models HTTP/1.0\r\n\r\n",
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40),
            ]
        )
        return "http:raw", raw, False
    if kind == 12:
        whole = _http(path, _json(base))
        return "client-leaves", whole[: rng.randrange(10, len(whole))], True
    if kind == 13:
        raw = _json({**base, "stream": True, "stream_options": rng.choice(WRONG[:5] + [{"x": 1}])})
        return "stream_options", _http(path, raw), False
    raise AssertionError(kind)


def grpc_case(rng: random.Random) -> tuple[str, str, bytes]:
    """(what, the method's path, the request's bytes)."""
    generate = "/pdserve.v1.Generation/Generate"
    kind = rng.randrange(6)
    if kind == 0:
        return (
            "grpc:random-bytes",
            generate,
            bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))),
        )
    if kind == 1:
        request = generate_request("hi", stop=["zz"], request_id="rr", max_tokens=2)
        raw = request.SerializeToString()
        target = rng.choice([b"hi", b"zz", b"rr"])
        return (
            "grpc:not-utf8",
            generate,
            raw.replace(target, rng.choice([b"\xed\xa0\x80", b"\xff\xfe"])),
        )
    if kind == 2:
        field, value = rng.choice(
            [("seed", 2**64 - 1), ("seed", 2**63), ("top_k", -2), ("top_k", -(2**31)),
             ("max_tokens", 0), ("max_tokens", 2**32 - 1), ("n", 0), ("n", 2**32 - 1),
             ("logprobs", 2**32 - 1), ("min_tokens", 2**32 - 1), ("temperature", float("nan")),
             ("temperature", float("inf")), ("temperature", -1.0), ("top_p", 0.0),
             ("top_p", float("nan")), ("min_p", 2.0), ("presence_penalty", 1e30),
             ("repetition_penalty", 0.0)]
        )  # fmt: skip
        request = generate_request([0, 5, 6], **{"max_tokens": 2, field: value})
        return f"grpc:{field}", generate, request.SerializeToString()
    if kind == 3:
        request = rng.choice(
            [generation_pb2.GenerateRequest(),
             generate_request([], max_tokens=2),
             generate_request("", max_tokens=2),
             generate_request([0, 2**32 - 1], max_tokens=2),
             generate_request([0, 5], stop_token_ids=[2**32 - 1], max_tokens=2),
             generate_request([0, 5], stop=["x" * 300], max_tokens=2),
             generate_request([0, 5], stop=["a"] * 40, max_tokens=2),
             generate_request([0, 5], stop=[""], max_tokens=2),
             generate_request([0, 5], request_id="r" * 1000, max_tokens=2),
             generate_request([0, 5], relaxed_acceptance=True, max_tokens=2)]
        )  # fmt: skip
        return "grpc:fields", generate, request.SerializeToString()
    if kind == 4:
        raw = bytearray(generate_request("hello", max_tokens=2, stop=["x"]).SerializeToString())
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return "grpc:flipped", generate, bytes(raw)
    request = rng.choice(
        [("/pdserve.v1.Admin/ScalePool", admin_pb2.ScalePoolRequest(count=1)),
         ("/pdserve.v1.Admin/ScalePool", admin_pb2.ScalePoolRequest(role=99, count=1)),
         ("/pdserve.v1.Admin/ScalePool", admin_pb2.ScalePoolRequest(role=1, count=2**32 - 1)),
         ("/pdserve.v1.Admin/DrainWorker", admin_pb2.DrainWorkerRequest(worker_id="nobody")),
         ("/pdserve.v1.Admin/DrainWorker", admin_pb2.DrainWorkerRequest(worker_id="\u2603" * 500))]
    )  # fmt: skip
    return "grpc:admin", request[0], request[1].SerializeToString()


async def send_http(port: int, raw: bytes, leaves: bool) -> tuple[str, bool]:
    """(the answer's status or what happened instead, whether a 4xx body was OpenAI-shaped)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        return f"connect:{type(e).__name__}", True
    try:
        writer.write(raw)
        if leaves:
            return "left", True
        with contextlib.suppress(OSError):  # answered (and closed) before all of it was sent
            await writer.drain()
        data = b""
        try:
            async with asyncio.timeout(30):
                while chunk := await reader.read(1 << 16):
                    data += chunk
        except TimeoutError:
            return "no-answer-30s", True
        except OSError as e:
            if not data:
                return f"reset:{type(e).__name__}", True
        if not data:
            return "closed-no-answer", True
        status = data.split(b" ", 2)[1].decode(errors="replace") if b" " in data else "?"
        shaped = True
        if status.startswith("4"):
            head, _, body = data.partition(b"\r\n\r\n")
            # The first answer's body only (bytes after a request may have been read as another one).
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            body = body[: int(length.group(1))] if length else body
            try:
                shaped = bool(json.loads(body)["error"]["message"])
            except (ValueError, KeyError, TypeError):
                shaped = False
        return status, shaped
    finally:
        writer.close()


async def send_grpc(channel: grpc.aio.Channel, method: str, raw: bytes) -> str:
    if method.endswith("Generate"):
        call = channel.unary_stream(method, request_serializer=lambda b: b)
        try:
            async for _ in call(raw, timeout=30):
                pass
            return "OK"
        except grpc.aio.AioRpcError as e:
            return e.code().name
    call = channel.unary_unary(method, request_serializer=lambda b: b)
    try:
        await call(raw, timeout=30)
        return "OK"
    except grpc.aio.AioRpcError as e:
        return e.code().name


async def _fire(args, http_port: int, grpc_port: int) -> dict:
    rng = random.Random(args.seed)
    outcomes: collections.Counter = collections.Counter()
    by_case: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unshaped: collections.Counter = collections.Counter()
    limit = asyncio.Semaphore(args.concurrency)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:

        async def one(i: int) -> None:
            async with limit:
                if rng.random() < args.grpc_share:
                    what, method, raw = grpc_case(rng)
                    answer = "grpc:" + await send_grpc(channel, method, raw)
                else:
                    what, raw, leaves = http_case(rng)
                    status, shaped = await send_http(http_port, raw, leaves)
                    answer = "http:" + status
                    if not shaped:
                        unshaped[what] += 1
                outcomes[answer] += 1
                by_case[what][answer] += 1

        await asyncio.gather(*(one(i) for i in range(args.requests)))
    faults = {
        a: n for a, n in outcomes.items()
        if a.startswith("http:5") or a in ("grpc:INTERNAL", "grpc:UNKNOWN")
        or a.startswith(("http:reset", "http:no-answer", "http:closed"))
    }  # fmt: skip
    return {
        "outcomes": dict(outcomes.most_common()),
        "faults": faults,
        "faulty_cases": {w: dict(c) for w, c in by_case.items() if any(a in faults for a in c)},
        "not_openai_shaped_4xx": dict(unshaped),
        "cases": len(by_case),
    }


def fire(args, http_port: int, grpc_port: int) -> dict:
    """The malformed requests, sent from a process of their own: the watchers' loop times only the server."""
    return asyncio.run(_fire(args, http_port, grpc_port))


async def run(args) -> dict:
    flags = [
        "--router.default-max-tokens", "4", "--router.http-header-timeout-s", "5",
        "--router.http-body-timeout-s", "5", "--router.max-queued-requests", "65536",
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
            result = await loop.run_in_executor(
                pool, fire, args, served.http_port, served.grpc_port
            )
            end = time.monotonic()
        await watchers.stop()
        return {
            "requests": args.requests,
            **result,
            "seconds": round(end - start, 1),
            "watchers_baseline": watchers.summary(base_start, base_end),
            "watchers_meanwhile": watchers.summary(start, end),
            "watcher_errors": watchers.errors[:5],
            "server_log": served.log_faults(),
        }
    finally:
        served.stop()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=32, help="malformed requests in flight")
    p.add_argument("--grpc-share", type=float, default=0.3, help="the share sent through gRPC")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--watchers", type=int, default=4, help="ordinary streaming clients")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per watcher request")
    p.add_argument("--baseline-s", type=float, default=10.0, help="watchers alone first")
    p.add_argument("--model", default="tiny")
    p.add_argument("--log", default="/tmp/pdserve-malformed-serve.log", help="the server's log")
    args = p.parse_args()
    summary = asyncio.run(run(args))
    print(json.dumps(summary, indent=2))
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "malformed.json"
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
