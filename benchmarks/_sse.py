"""A lean streaming client for OpenAI-style server-sent events, for the benchmarks: one POST per connection over
asyncio streams, events handed over per socket read with the time they arrived. It parses nothing but the status
line and the event boundaries, so that the client's own cost stays far below the server's (an HTTP library's
per-event work would be measured as the server's latency)."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator


class HttpStatusError(Exception):
    """The server answered with a status other than 200; the message holds the start of its body."""


def split_url(base_url: str) -> tuple[str, int, str, bool]:
    """(host, port, path prefix, TLS) of an `http[s]://host:port/prefix` URL."""
    url = urllib.parse.urlsplit(base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"{base_url!r}: expected http[s]://HOST[:PORT][/PATH]")
    tls = url.scheme == "https"
    return url.hostname, url.port or (443 if tls else 80), url.path.rstrip("/"), tls


async def post_events(
    base_url: str, path: str, body: dict, api_key: str | None = None
) -> AsyncIterator[tuple[float, list[bytes]]]:
    """POSTs `body` as JSON to base_url + path and yields (time.monotonic() of a socket read, the complete
    `data:` payloads it finished), `[DONE]` included. Raises HttpStatusError on a status other than 200."""
    host, port, prefix, tls = split_url(base_url)
    payload = json.dumps(body).encode()
    auth = f"authorization: Bearer {api_key}\r\n".encode() if api_key else b""
    reader, writer = await asyncio.open_connection(
        host, port, ssl=ssl.create_default_context() if tls else None
    )
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s"
        % ((prefix + path).encode(), host.encode(), auth, len(payload), payload)
    )
    buffer, head_done = b"", False
    try:
        while data := await reader.read(1 << 16):
            now = time.monotonic()
            buffer += data
            if not head_done:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    continue
                head, buffer, head_done = buffer[:end], buffer[end + 4 :], True
                if not head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                    rest = await reader.read(1 << 12)
                    raise HttpStatusError((head.split(b"\r\n")[0] + b": " + buffer + rest).decode(
                        errors="replace"
                    )[:500])  # fmt: skip
            # Chunked framing sits between events (`\r\n<size>\r\n`): only `data: ` lines are read.
            *events, buffer = buffer.split(b"\n\n")
            payloads = [e[e.index(b"data: ") + 6 :] for e in events if b"data: " in e]
            if payloads:
                yield now, payloads
    finally:
        writer.close()
