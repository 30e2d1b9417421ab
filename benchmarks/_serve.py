"""What the fail-closed benchmarks (slow_clients.py, malformed.py) share: `pdserve serve` in a child process on
free ports with its log in a file, the log's ERROR lines and tracebacks counted, and `Watchers`: a few ordinary
streaming clients that run beside an attack and record every gap between the chunks they receive, and a
/health pinger that times the front end's event loop alone."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
from _sse import HttpStatusError, post_events

_SERVE_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `pdserve serve` child: its ports, its process and its log."""

    def __init__(self, model: str, log: Path, flags: list[str]):
        self.grpc_port, self.http_port, self.log = free_port(), free_port(), log
        command = [
            sys.executable, "-m", "pdserve.cli.main", "serve", "--model", model, "--prefill", "0",
            "--decode", "1", "--port", str(self.grpc_port), "--http-port", str(self.http_port),
            "--cluster.cpus-per-worker", "0.5", "--router.stats-interval-s", "0", *flags,
        ]  # fmt: skip
        self._log_file = open(log, "w")  # noqa: SIM115 (the child writes it until stop)
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT)
        give_up = time.monotonic() + _SERVE_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=2):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > give_up:
                    self.stop()
                    sys.exit(f"pdserve serve did not come up; see {log}")
                time.sleep(0.5)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log_file.close()

    def log_faults(self) -> dict[str, int]:
        """Tracebacks, ERROR lines and 5xx-worthy lines in the server's log so far."""
        text = self.log.read_text(errors="replace")
        return {
            "tracebacks": text.count("Traceback (most recent call last)"),
            "error_lines": len(re.findall(r"^\S+ \S+ ERROR ", text, re.M)),
        }


class Watchers:
    """`count` clients each streaming one request after another (greedy, `max_tokens` tokens, EOS ignored)
    until stopped; every gap between two chunks of a stream, and every time to a first chunk, is kept with
    the time it ended."""

    def __init__(self, url: str, count: int, max_tokens: int):
        self.url, self.count, self.max_tokens = url, count, max_tokens
        self.gaps: list[tuple[float, float]] = []  # (when it ended, seconds)
        self.first_chunks: list[tuple[float, float]] = []
        self.pings: list[tuple[float, float]] = []  # (when it was answered, seconds)
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.count)]
        self._tasks.append(asyncio.create_task(self._pinger()))

    async def _pinger(self) -> None:
        """GET /health every 10 ms on one keep-alive connection: its latency is the front end's event loop
        (and this client's), without the decode worker: a stream gap with no slow ping is the worker's."""
        url = urllib.parse.urlsplit(self.url)
        request = b"GET /health HTTP/1.1\r\nhost: bench\r\n\r\n"
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(url.hostname, url.port)
                while not self._stop.is_set():
                    sent = time.monotonic()
                    writer.write(request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    await reader.readexactly(length)
                    now = time.monotonic()
                    self.pings.append((now, now - sent))
                    await asyncio.sleep(0.01)
                writer.close()
            except (OSError, asyncio.IncompleteReadError, IndexError) as e:
                self.errors.append(f"ping: {e}"[:200])
                await asyncio.sleep(0.1)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _client(self) -> None:
        body = {
            "prompt": "Once upon a time", "max_tokens": self.max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0,
        }  # fmt: skip
        while not self._stop.is_set():
            sent = last = time.monotonic()
            first = True
            try:
                async for now, _ in post_events(self.url, "/completions", body):
                    if first:
                        self.first_chunks.append((now, now - sent))
                        first = False
                    else:
                        self.gaps.append((now, now - last))
                    last = now
            except (HttpStatusError, OSError) as e:
                self.errors.append(str(e)[:200])
                await asyncio.sleep(0.1)

    def summary(self, start: float, end: float) -> dict:
        """Gaps, first chunks and /health pings that ended within [start, end]: their count, p50, p99 and max (ms)."""

        def stats(pairs):
            values = np.array([v for t, v in pairs if start <= t <= end]) * 1e3
            if not len(values):
                return {"n": 0}
            return {
                "n": int(len(values)),
                "p50_ms": round(float(np.percentile(values, 50)), 1),
                "p99_ms": round(float(np.percentile(values, 99)), 1),
                "max_ms": round(float(values.max()), 1),
                "over_100ms": int((values > 100).sum()),
            }

        return {
            "gaps": stats(self.gaps),
            "first_chunk": stats(self.first_chunks),
            "health_ping": stats(self.pings),
        }
