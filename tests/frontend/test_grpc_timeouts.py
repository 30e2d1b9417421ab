"""Slow and vanished gRPC clients are cut, as HTTP ones are: a client that reads nothing of its stream has its
request cancelled after router.http_idle_timeout_s, one that vanishes (its network gone) is cut when a keepalive
ping goes unanswered for router.grpc_keepalive_s, one that trickles its request message is cut after
router.http_body_timeout_s, and connections that send nothing are closed. A small gRPC
server with short timeouts serves the shared server's engine (its router and workers), on the shared server's
event loop, with the production servicers and transport options."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time

import grpc
import pytest
from serving import greedy, wait_for

from pdserve.frontend.grpc_service import add_servicers, server_options
from pdserve.v1 import generation_pb2_grpc

IDLE_S, HANDSHAKE_S, BODY_S, KEEPALIVE_S = 1.0, 1.0, 1.0, 0.5


class _ShortTimeouts:
    """The shared server's engine, with its router limits' timeouts shortened."""

    def __init__(self, engine, limits):
        self._engine, self.limits = engine, limits

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _small_server(shared_server, **timeouts):
    """A gRPC server on the shared server's loop and engine, with the router's `timeouts` changed; yields its
    port."""
    engine = shared_server.server.engine
    limits = dataclasses.replace(engine.limits, **timeouts)

    async def start():
        server = grpc.aio.server(options=server_options(limits))
        add_servicers(_ShortTimeouts(engine, limits), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = shared_server.call(start())
    yield port
    shared_server.call(server.stop(0))


@pytest.fixture(scope="module")
def short_server(shared_server):
    yield from _small_server(
        shared_server,
        http_idle_timeout_s=IDLE_S,
        http_header_timeout_s=HANDSHAKE_S,
        http_body_timeout_s=BODY_S,
    )


@pytest.fixture(scope="module")
def keepalive_server(shared_server):
    # a stalled write is cut only long after the keepalive's answer is missed
    yield from _small_server(shared_server, grpc_keepalive_s=KEEPALIVE_S, http_idle_timeout_s=60.0)


def test_a_stalled_stream_reader_is_cut_and_its_request_freed(shared_server, short_server, caplog):
    caplog.set_level(logging.INFO)
    router = shared_server.server.router
    # A small receive window: the server's writes block after a few responses the client does not read.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    with grpc.insecure_channel(f"127.0.0.1:{short_server}", options=options) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        stream = stub.Generate(greedy(list(range(3, 20)), max_tokens=200, logprobs=5), timeout=60)
        next(stream)
        stalled_at = time.monotonic()
        wait_for(
            lambda: not router.requests, IDLE_S + 5, "the stalled stream's request was not freed"
        )
        freed_s = time.monotonic() - stalled_at
        assert freed_s >= IDLE_S * 0.9, f"cut after {freed_s:.2f}s, before the idle timeout"
        cut = [r.getMessage() for r in caplog.records if "gRPC client" in r.getMessage()]
        assert len(cut) == 1 and "router.http_idle_timeout_s" in cut[0], cut
        # Reading again, the client gets what was sent before the cut and then the cut's status.
        with pytest.raises(grpc.RpcError) as e:
            for _ in stream:
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "http_idle_timeout_s" in e.value.details()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _closed_within(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the peer closes `sock` (reading and dropping what it sends); fails past limit_s."""
    start = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        pytest.fail(f"the connection was still open after {limit_s}s")
    except ConnectionResetError:
        pass
    return time.monotonic() - start


@pytest.mark.parametrize("preface", [False, True], ids=["nothing", "preface-only"])
def test_a_connection_that_sends_nothing_is_closed(short_server, preface):
    with socket.create_connection(("127.0.0.1", short_server), timeout=5) as sock:
        if preface:  # a valid HTTP/2 start (preface, empty SETTINGS), then no call
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
        closed_s = _closed_within(sock, max(HANDSHAKE_S, IDLE_S) + 4)
    assert closed_s >= min(HANDSHAKE_S, IDLE_S) * 0.9


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK header field, literal without indexing."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def test_a_trickled_request_message_is_cut_at_the_body_timeout(short_server, caplog):
    """A live HTTP/2 client (it acknowledges SETTINGS and pings) that starts a Generate call and sends its
    request message a byte at a time gets the call ended (trailers or RST_STREAM) after the body timeout."""
    caplog.set_level(logging.INFO)
    headers = b"".join(
        _literal(n, v)
        for n, v in [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/pdserve.v1.Generation/Generate"),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]  # fmt: skip
    )
    with socket.create_connection(("127.0.0.1", short_server), timeout=0.2) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0))
        sock.sendall(
            _frame(1, 4, 1, headers) + _frame(0, 0, 1, b"\x00" + (1000).to_bytes(4, "big"))
        )
        start, buf, ended = time.monotonic(), b"", None
        while ended is None and time.monotonic() - start < BODY_S + 5:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                sock.sendall(_frame(0, 0, 1, b"\x0a"))  # one more byte of the message
                continue
            assert data, "the connection closed instead of the call ending"
            buf += data
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                size = int.from_bytes(buf[:3], "big")
                kind, flags, stream, payload = buf[3], buf[4], buf[5:9], buf[9 : 9 + size]
                buf = buf[9 + size :]
                if kind in (4, 6) and not flags & 1:  # acknowledge SETTINGS and PINGs
                    sock.sendall(_frame(kind, 1, 0, payload if kind == 6 else b""))
                elif int.from_bytes(stream, "big") == 1 and (
                    kind == 3 or (kind == 1 and flags & 1)
                ):
                    ended = time.monotonic() - start
    assert ended is not None, f"the call was still open after {BODY_S + 5}s of trickling"
    assert BODY_S * 0.9 <= ended < BODY_S + 3
    cut = [r.getMessage() for r in caplog.records if "did not arrive within" in r.getMessage()]
    assert len(cut) == 1 and "router.http_body_timeout_s" in cut[0], cut


def test_a_served_client_is_not_cut(short_server):
    """A client that reads its stream and pauses between calls (under the idle timeout) is served."""
    with grpc.insecure_channel(f"127.0.0.1:{short_server}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for _ in range(2):
            tokens = [
                t
                for r in stub.Generate(greedy([3, 4, 5], max_tokens=8), timeout=60)
                for t in r.token_ids
            ]
            assert len(tokens) == 8
            time.sleep(IDLE_S / 2)


class _Proxy(threading.Thread):
    """Forwards one TCP connection to 127.0.0.1:`port` until `vanish` is set; from then on it forwards
    nothing either way and keeps both sockets open, as a client whose host or network went away."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.upstream_port = self.listener.getsockname()[1], port
        self.vanish, self.done = threading.Event(), threading.Event()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.05)
        while not self.vanish.is_set() and not self.done.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            dst.sendall(data)

    def run(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        pumps = [
            threading.Thread(target=self._pump, args=pair, daemon=True)
            for pair in ((client, upstream), (upstream, client))
        ]
        for t in pumps:
            t.start()
        self.done.wait()
        for sock in (client, upstream, self.listener):
            sock.close()


def test_a_vanished_client_is_cut_by_keepalive_and_its_request_freed(
    shared_server, keepalive_server, caplog
):
    caplog.set_level(logging.INFO)
    router = shared_server.server.router
    proxy = _Proxy(keepalive_server)
    proxy.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            # long enough to be running still when the keepalive cuts it (the socket buffers take its output)
            stream = stub.Generate(greedy(list(range(3, 20)), max_tokens=2000), timeout=60)
            next(stream)
            proxy.vanish.set()
            vanished_at = time.monotonic()
            wait_for(
                lambda: not router.requests,
                2 * KEEPALIVE_S + 5,
                "the vanished client's request was not freed",
            )
            assert time.monotonic() - vanished_at >= KEEPALIVE_S * 0.9
            stream.cancel()
    finally:
        proxy.done.set()
        proxy.join(5)
    logged = [r.getMessage() for r in caplog.records]
    assert any("cancelled by the client" in m for m in logged), logged
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
