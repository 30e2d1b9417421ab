"""The HTTP connection as the front end serves it: uvicorn's h11 protocol with deadlines, so that a slow or
vanished client holds nothing for long, and with a close that lets a client read its answer.

- Headers: a connection must deliver a request's line and headers within `header_s` of opening, or of its
  previous response (this is also how long an idle keep-alive connection stays open).
- Body: the request's body must arrive whole within `body_s` of its headers.
  Past either deadline the client gets 408 with an OpenAI-shaped body, unless a response is already under
  way, and the connection is closed; the request's handler sees a disconnect (its request is cancelled).
- Idle stream: a response whose writes stay blocked (the client reads nothing) for `idle_s` is cut at once.
- A close while the client may still be sending (an early 413 to an oversized upload, a 408) is lingering:
  the server shuts its side for writing and reads and drops what still comes for up to `LINGER_S`, so that
  the client reads the answer instead of a connection reset (which closing over unread data would send).
- A request that is not HTTP gets 400 with an OpenAI-shaped body (uvicorn's own answer is plain text).

Each cut is logged at INFO, once. uvicorn's h11 protocol is used whether or not httptools is installed, so
that these rules hold on every install."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

LINGER_S = 5.0
"""Longest a closing connection keeps reading (and dropping) what its client still sends."""


@dataclasses.dataclass(frozen=True, slots=True)
class Deadlines:
    """The HTTP timeouts (router.http_header_timeout_s, http_body_timeout_s, http_idle_timeout_s), seconds."""

    header_s: float
    body_s: float
    idle_s: float


def error_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, its body an OpenAI-shaped error."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Transport:
    """The connection's transport as uvicorn's protocol and request cycle see it: every call passes through,
    but close() is the protocol's lingering close."""

    def __init__(self, transport: asyncio.Transport, protocol: DeadlineProtocol):
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_lingering()

    def is_closing(self) -> bool:
        """True from the start of a lingering close: uvicorn then arms no keep-alive and starts no request."""
        return self._protocol.closing or self._transport.is_closing()


_UVICORN_INVALID = "Invalid HTTP request received."


class _Logger:
    """uvicorn's logger as a connection uses it, less its WARNING for bytes that are not HTTP (a client's
    fault, logged at INFO with its address by `send_400_response`); every other record passes through."""

    def __init__(self, logger: logging.Logger):
        self._logger = logger

    def __getattr__(self, name: str):
        return getattr(self._logger, name)

    def warning(self, msg, *args, **kwargs) -> None:
        if msg != _UVICORN_INVALID:
            self._logger.warning(msg, *args, **kwargs)


class DeadlineProtocol(H11Protocol):
    """uvicorn's H11Protocol with the deadlines of this module's docstring. Instantiate through
    `protocol_factory` (uvicorn passes config, server_state and app_state)."""

    def __init__(self, *args, deadlines: Deadlines, **kwargs):
        super().__init__(*args, **kwargs)
        self.logger = _Logger(self.logger)  # type: ignore[assignment]
        self.deadlines = deadlines
        self._raw: asyncio.Transport | None = None
        self._phase: str | None = None
        """What the connection waits for from its client: "headers", "body", or None (nothing: its request is
        whole, or the connection is closing)."""
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self.closing = False
        """Set once the connection is closing (lingering or not): nothing more is read into a request."""

    # Connection life.

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        self.transport = _Transport(transport, self)  # type: ignore[assignment]
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return  # lingering: what the client still sends is dropped
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The header deadline (armed by _track for the next request) stands for uvicorn's keep-alive timer.
        self._unset_keepalive_if_required()
        self._track()

    def shutdown(self) -> None:
        if self.closing:
            if self._raw is not None:
                self._raw.close()
            return
        super().shutdown()

    # Deadlines.

    def _track(self) -> None:
        """Arms the deadline of what the connection now waits for from its client, when that changed."""
        if self.closing:
            return
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            delay = self.deadlines.header_s if phase == "headers" else self.deadlines.body_s
            self._deadline = self.loop.call_later(delay, self._expired, phase)

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if self.closing:
            return
        limit = self.deadlines.header_s if phase == "headers" else self.deadlines.body_s
        setting = "http_header_timeout_s" if phase == "headers" else "http_body_timeout_s"
        cycle = self.cycle if phase == "body" else None
        if phase == "headers" and self.conn.their_state is h11.IDLE and not self._partial_request():
            # An idle keep-alive connection: closed quietly, as uvicorn's keep-alive timeout closes it.
            self.close_lingering()
            return
        logger.info(
            "HTTP client %s cut: its request's %s did not arrive within %gs (router.%s)",
            _peer(self.client), phase, limit, setting,
        )  # fmt: skip
        if cycle is None or not cycle.response_started:
            self._raw.write(
                error_bytes(
                    408, "Request Timeout",
                    f"the request's {phase} did not arrive within {limit:g}s (router.{setting})",
                    "request_timeout",
                )
            )  # fmt: skip
        if cycle is not None and not cycle.response_complete:
            # The request's handler now reads a disconnect and cancels its request; its answer goes nowhere.
            cycle.disconnected = True
            cycle.message_event.set()
            cycle.scope["pdserve.cut"] = True
        self.close_lingering()

    def _partial_request(self) -> bool:
        """Whether part of a next request has arrived (bytes that h11 holds, not yet a whole head)."""
        data, _ = self.conn.trailing_data
        return bool(data)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.deadlines.idle_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        logger.info(
            "HTTP client %s cut: it read nothing of its response for %gs (router.http_idle_timeout_s)",
            _peer(self.client), self.deadlines.idle_s,
        )  # fmt: skip
        if self.cycle is not None:
            self.cycle.scope["pdserve.cut"] = True
        self.closing = True
        self._cancel_timers()
        self._raw.abort()  # what is buffered cannot be delivered: drop it with the connection

    def _cancel_timers(self) -> None:
        for handle in (self._deadline, self._stall):
            if handle is not None:
                handle.cancel()
        self._deadline = self._stall = None

    # Closing.

    def close_lingering(self) -> None:
        """Closes the connection; while its client may still be sending (a request unread, or unparsed bytes),
        first shuts the write side and drops what comes for up to LINGER_S (or until the client's EOF)."""
        raw = self._raw
        if raw is None or self.closing:
            return
        self.closing = True
        self._phase = None
        self._cancel_timers()
        if raw.is_closing():
            return
        state = self.conn.their_state
        still_sending = state in (h11.SEND_BODY, h11.ERROR) or (
            state is h11.IDLE and self._partial_request()
        )
        if not still_sending:
            raw.close()
            return
        if raw.can_write_eof():
            raw.write_eof()
        raw.resume_reading()
        # The client's EOF closes it sooner (eof_received's default).
        self._linger = self.loop.call_later(LINGER_S, raw.close)

    def send_400_response(self, msg: str) -> None:
        """Bytes that are not an HTTP request: 400 with an OpenAI-shaped body, then a lingering close."""
        logger.info(
            "HTTP client %s sent bytes that are not an HTTP/1.1 request", _peer(self.client)
        )
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.scope["pdserve.cut"] = (
                True  # its handler reads a disconnect: logged here, once
            )
        self._raw.write(
            error_bytes(400, "Bad Request", "not a valid HTTP/1.1 request", "bad_request")
        )
        self.close_lingering()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "(unknown)"


def protocol_factory(deadlines: Deadlines):
    """The `http` protocol class argument of uvicorn.Config: DeadlineProtocol with these deadlines."""

    def make(*args, **kwargs) -> DeadlineProtocol:
        return DeadlineProtocol(*args, deadlines=deadlines, **kwargs)

    return make
