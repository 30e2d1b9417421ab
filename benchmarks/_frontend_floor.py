"""The floor for benchmarks/frontend.py (`--floor`): a server with no router, no Ray and no engine, in the same
stack as pdserve's front ends (Starlette on uvicorn, grpc.aio, one asyncio loop in one process), that streams
the same chunks on the same tick grid. What the front-end benchmark's client receives from it on a machine is
what any Python front end there can be measured at; pdserve's figures are read against it.

    python benchmarks/_frontend_floor.py --grpc-port P --http-port Q --interval-ms 20 --tokens-per-tick 5

Tick n falls at n * interval on the monotonic clock; each open stream gets, per tick, tokens-per-tick tokens of
the symbol SYMBOLS[n mod 62] (`pdserve.cluster.fixed_rate_decode`), and a stream that fell behind gets the ticks
it missed in one chunk named by the first of them, as pdserve's router coalesces. HTTP: `POST /v1/completions`
with `max_tokens` (server-sent events shaped as pdserve's), `GET /health`. gRPC: `Generation.Generate`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import time

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from pdserve.cluster.fixed_rate_decode import SYMBOLS
from pdserve.v1 import generation_pb2, generation_pb2_grpc


class Ticker:
    """Wakes every waiter at each tick of the grid."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.tick = math.floor(time.monotonic() / interval_s)
        self._changed = asyncio.Condition()

    async def run(self) -> None:
        while True:
            next_at = (self.tick + 1) * self.interval_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            async with self._changed:
                self.tick = math.floor(time.monotonic() / self.interval_s)
                self._changed.notify_all()

    async def after(self, tick: int) -> int:
        """The latest tick, once it is past `tick`."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.tick > tick)
            return self.tick


async def chunks(ticker: Ticker, max_tokens: int, per_tick: int):
    """(text, tokens) per chunk until max_tokens."""
    sent, last = 0, ticker.tick
    while sent < max_tokens:
        now = await ticker.after(last)
        n = min((now - last) * per_tick, max_tokens - sent)
        yield SYMBOLS[(last + 1) % len(SYMBOLS)] * n, n
        sent, last = sent + n, now


def http_app(ticker: Ticker, per_tick: int) -> Starlette:
    async def completions(request):
        body = json.loads(await request.body())

        async def events():
            async for text, _ in chunks(ticker, int(body["max_tokens"]), per_tick):
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
                event = {"id": "cmpl-floor", "object": "text_completion", "created": 0,
                         "model": "floor", "choices": [choice]}  # fmt: skip
                yield b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_):
        return PlainTextResponse("ok")

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ]
    )


class Generation(generation_pb2_grpc.GenerationServicer):
    def __init__(self, ticker: Ticker, per_tick: int):
        self.ticker, self.per_tick = ticker, per_tick

    async def Generate(self, request, context):  # noqa: N802 (the gRPC method's name)
        max_tokens = request.sampling_params.max_tokens
        async for text, n in chunks(self.ticker, max_tokens, self.per_tick):
            token_ids = [SYMBOLS.index(text[0])] * n
            yield generation_pb2.GenerateResponse(
                request_id=request.request_id, token_ids=token_ids, text=text
            )


async def serve(args) -> None:
    ticker = Ticker(args.interval_ms / 1e3)
    tick_task = asyncio.create_task(ticker.run())
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1 << 16)])
    generation_pb2_grpc.add_GenerationServicer_to_server(
        Generation(ticker, args.tokens_per_tick), server
    )
    server.add_insecure_port(f"127.0.0.1:{args.grpc_port}")
    await server.start()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.http_port))
    config = uvicorn.Config(
        http_app(ticker, args.tokens_per_tick), lifespan="off", log_config=None, access_log=False
    )
    try:
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        tick_task.cancel()
        await server.stop(1)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--tokens-per-tick", type=int, default=1)
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
