"""The OpenAI-compatible HTTP front end, a peer of the gRPC servicers over `EngineClient`, served by uvicorn on the
router's event loop: /v1/models, /v1/completions, /v1/chat/completions (streamed as server-sent events or whole),
vLLM's /tokenize, /detokenize and /tokenizer_info (`tokenizer_api`), /health, /version and /metrics (Prometheus'
text format; `metrics_only` serves that alone, on a port of its own).

A request's body over the cap is answered 413 before the rest of it is read; a body within it is decoded and
checked (`json_body`: depth, Unicode) and translated into a `RequestInput` per prompt for `request_builder`
(a completions request may list prompts: `prompt_batch`; parameters ignored are named in a response header and
warned about once: `openai_fields`); parsing a large body and checking the request (rendering the chat template,
tokenizing) run in a worker thread, so that other streams keep flowing meanwhile. The response waits for the
first chunk before it starts, so that errors of admission (429, 503) and of the request (400) get their status;
after that an error arrives as a last `data: {"error": ...}` event. A client that disconnects, before or during the
stream, cancels its request: its pages are freed on every worker (one INFO line). Errors have OpenAI's shape
(`errors.http_error_for`), Starlette's own 404 and 405 too. Connections are `http_protocol`'s: deadlines for
headers, body and a response the client stops reading, and a close that lets a client read an early answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdserve.cluster.errors import NotFoundError, UnavailableError
from pdserve.engine.messages import SpecCounts
from pdserve.engine.sampling_params import FinishReason
from pdserve.frontend import openai_api as api
from pdserve.frontend.chat_output import ChatOutput
from pdserve.frontend.echo import Echoes
from pdserve.frontend.engine_client import Choices, Chunk, EngineClient
from pdserve.frontend.errors import BodyTooLargeError, http_error_for
from pdserve.frontend.http_protocol import Deadlines, protocol_factory
from pdserve.frontend.json_body import decode_body
from pdserve.frontend.openai_fields import IgnoredFieldsLog
from pdserve.frontend.prompt_batch import submit_all
from pdserve.frontend.request_builder import build_request
from pdserve.frontend.security import Credentials, require_key
from pdserve.frontend.tokenizer_api import TokenizerEndpoints
from pdserve.frontend.validation import prompt_bytes_limit
from pdserve.model.errors import PdserveError

logger = logging.getLogger(__name__)

_PARSE_IN_THREAD_BYTES = 64 << 10
"""Bodies larger than this are decoded from JSON in a worker thread."""
_STARTUP_TIMEOUT_S = 10.0
_TOKEN_TEXTS_KEPT = 1 << 18
"""Token texts remembered for log-probabilities (a vocabulary's worth: DeepSeek-V3 has 129,280 tokens)."""


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


class _ClientGone(Exception):
    """The HTTP client disconnected."""


class _ErrorResponse(JSONResponse):
    """An error's JSON, every character past ASCII escaped: an error may quote request text, which need not
    be encodable (a lone surrogate)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such path: 404, a method the path does not take: 405) in OpenAI's shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path:.200}: {exc.detail}"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return _ErrorResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _until_disconnect(receive: Receive, work: Awaitable):
    """`work`'s result, or _ClientGone as soon as the client disconnects (its body already read)."""
    work = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        raise _ClientGone
    return work.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _peer(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "(unknown)"


def _stages(chunk: Chunk | None) -> dict[str, float] | None:
    """A choice's stage times for the usage object (`Timings.stage_dict`), where its last chunk has timings."""
    return None if chunk is None or chunk.timings is None else chunk.timings.stage_dict()


def _sse(data: dict) -> bytes:
    return (
        b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


_DONE = b"data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """A server-sent event stream that ends (closing its events, which cancels the request) as soon as the client
    disconnects, whether or not an event is being written."""

    def __init__(
        self, events: AsyncIterator[bytes], request_id: str, headers: dict[str, str] | None = None
    ):
        super().__init__(
            events, media_type="text/event-stream",
            headers={"cache-control": "no-cache", **(headers or {})},
        )  # fmt: skip
        self.events, self.request_id = events, request_id

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _until_disconnect(receive, self._send_all(send))
        except (_ClientGone, OSError):
            logger.info("request %s cancelled: the HTTP client disconnected", self.request_id)
        finally:
            await self.events.aclose()


class _Server(uvicorn.Server):
    def capture_signals(self):
        """The serving process handles SIGINT/SIGTERM itself (a graceful stop of both front ends)."""
        return contextlib.nullcontext()


class HttpFrontEnd:
    """The Starlette app and its uvicorn server. `start` and `stop` run on the server's event loop."""

    def __init__(
        self, engine: EngineClient, reasoning_parser: str, metrics_only: bool = False,
        credentials: Credentials | None = None,
    ):  # fmt: skip
        self.engine = engine
        model = engine.model
        self.reasoning = model.thinks if reasoning_parser == "auto" else reasoning_parser != "none"
        # auto: the output starts as reasoning only where the prompt opened a think block; deepseek_r1:
        # always, as vLLM's parser of that name assumes (R1's templates always open one)
        self._think_from_prompt = reasoning_parser == "auto"
        self.port = 0
        routes = [Route("/metrics", self.metrics, methods=["GET"])]
        if not metrics_only:
            routes += [
                Route("/health", self.health, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                *TokenizerEndpoints(model, engine.limits, self._read_json, self._error).routes(),
            ]
        app = Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})
        self.app = require_key(app, credentials or Credentials(), self._error)
        self._token_texts: dict[int, str] = {}
        self._ignored = IgnoredFieldsLog()
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    # Lifecycle.

    async def start(
        self, host: str, port: int, graceful_s: float, ssl_options: dict | None = None
    ) -> int:
        """Listens on host:port (0: a free port) and returns the port; `ssl_options`
        (`security.http_ssl_options`) makes it HTTPS."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port = sock.getsockname()[1]
        limits = self.engine.limits
        deadlines = Deadlines(
            limits.http_header_timeout_s, limits.http_body_timeout_s, limits.http_idle_timeout_s
        )
        config = uvicorn.Config(
            self.app, http=protocol_factory(deadlines), lifespan="off", log_config=None,
            access_log=False, timeout_keep_alive=deadlines.header_s,
            timeout_graceful_shutdown=graceful_s, **(ssl_options or {}),
        )  # fmt: skip
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http")
        give_up = time.monotonic() + _STARTUP_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            if time.monotonic() > give_up:
                raise RuntimeError(f"the HTTP server did not start within {_STARTUP_TIMEOUT_S}s")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task

    # Plain endpoints.

    async def health(self, request: Request) -> Response:
        if self.engine.healthy:
            return Response(status_code=200)
        why = "no decode worker is serving (starting up, shutting down, or all lost)"
        return self._error(UnavailableError(why))

    async def metrics(self, request: Request) -> Response:
        body, content_type = self.engine.metrics_exposition()
        return Response(body, headers={"content-type": content_type})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": _version()})

    async def models(self, request: Request) -> Response:
        model = self.engine.model
        card = {
            "id": model.name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "root": model.name,
            "max_model_len": model.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    # Generation.

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, api.COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, api.CHAT)

    def _error(self, error: BaseException, what: str = "") -> Response:
        if isinstance(error, _ClientGone):  # left before its body arrived: nobody to answer
            return Response(status_code=499)
        if not isinstance(error, PdserveError):
            logger.error("%s failed", what or "HTTP request", exc_info=error)
        e = http_error_for(error)
        # An oversized body is answered before it is read: the connection closes (lingering) after.
        headers = {"connection": "close"} if e.status == 413 else None
        return _ErrorResponse(e.body(), status_code=e.status, headers=headers)

    async def _read_json(self, request: Request):
        prompt_limit, what = prompt_bytes_limit(self.engine.limits, self.engine.model)
        limit = 2 * prompt_limit + (1 << 20)
        too_big = BodyTooLargeError(
            "body", f"larger than this server's limit of {limit} bytes (twice {what}, plus 1 MiB)"
        )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_big
                parts.append(part)
        except ClientDisconnect:
            raise _ClientGone from None
        body = b"".join(parts)
        if len(body) > _PARSE_IN_THREAD_BYTES:
            return await asyncio.to_thread(decode_body, body)
        return decode_body(body)

    def _token_text(self, token_id: int) -> str:
        """A token's own text, as log-probabilities name it (`token_id:N` for a model without a tokenizer)."""
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self.engine.model.tokenizer
            if tokenizer is None:
                text = api.token_id_text(token_id)
            else:
                text = tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < _TOKEN_TEXTS_KEPT:
                self._token_texts[token_id] = text
        return text

    def _logprobs(self, req: api.OpenAIRequest, chunk: Chunk, text_offset: int) -> dict | None:
        """A chunk's tokens' log-probabilities in the shape of the request's API (None where not asked)."""
        if chunk.logprobs is None:
            return None
        token_text = api.token_id_text if req.tokens_as_ids else self._token_text
        if req.kind == api.CHAT:
            return api.chat_logprobs(chunk.token_ids, chunk.logprobs, token_text)
        return api.completion_logprobs(chunk.token_ids, chunk.logprobs, token_text, text_offset)

    async def _generate(self, request: Request, kind: str) -> Response:
        engine = self.engine
        try:
            engine.check_ready()
            req = api.parse(await self._read_json(request), kind)
            if req.model is not None and req.model != engine.model.name:
                raise NotFoundError(
                    f"model {req.model!r:.100} is not served here (this server serves {engine.model.name!r}; "
                    "see /v1/models)"
                )
            head = api.ResponseHead(api.new_id(kind), engine.model.name)
            given = [dataclasses.replace(g, client_id=head.id) for g in req.inputs]
            # Templates and tokenizing take CPU: off the loop, other streams keep flowing meanwhile.
            checked = await asyncio.to_thread(
                lambda: [build_request(g, engine.model, engine.limits) for g in given]
            )
            echo = Echoes(req, checked, engine.model.tokenizer, self._token_text)
            generation = submit_all(engine, checked)
        except _ClientGone:
            # A client the connection cut (a deadline) was logged there; one that left is logged here.
            if not request.scope.get("pdserve.cut"):
                logger.info(
                    "HTTP client %s left before its %s request arrived", _peer(request), kind
                )
            return Response(status_code=499)
        except Exception as e:  # process boundary
            return self._error(e, f"{kind} request")
        try:
            first = await _until_disconnect(request.receive, _next(generation))
        except _ClientGone:
            logger.info("request %s cancelled: the HTTP client disconnected", generation.request_id)
            generation.cancel()
            return Response(status_code=499)
        except Exception as e:  # process boundary
            generation.cancel()
            return self._error(e, f"request {generation.request_id}")
        reasoning = None
        if self.reasoning and kind == api.CHAT:
            reasoning = checked[0].prompt_in_think or not self._think_from_prompt
        output = functools.partial(ChatOutput, checked[0], reasoning)
        headers = self._ignored.headers(req.ignored)
        prompt_tokens = sum(len(c.prompt_ids) for c in checked)
        if req.stream:
            events = self._events(req, head, generation, first, output, prompt_tokens, echo)
            return _EventStream(events, generation.request_id, headers)
        try:
            answer = self._whole(req, head, generation, first, output, prompt_tokens, echo)
            reply = await _until_disconnect(request.receive, answer)
            reply.headers.update(headers)
            return reply
        except _ClientGone:
            logger.info("request %s cancelled: the HTTP client disconnected", generation.request_id)
            return Response(status_code=499)
        except Exception as e:  # process boundary
            return self._error(e, f"request {generation.request_id}")
        finally:
            generation.cancel()

    async def _whole(
        self, req: api.OpenAIRequest, head: api.ResponseHead, generation: Choices, first: Chunk,
        output: Callable[[], ChatOutput], prompt_tokens: int, echo: Echoes,
    ) -> Response:  # fmt: skip
        """output: a chat choice's answer is made by one of these; prompt_tokens: of every prompt of the
        request, summed (the usage's); echo: what choices start with."""
        num = req.num_choices
        pieces: list[list[str]] = [[] for _ in range(num)]
        token_ids: list[list[int]] = [[] for _ in range(num)]
        logprobs: list[list] = [[] for _ in range(num)]
        last: list[Chunk | None] = [None] * num
        chunk = first
        while True:
            i, chunk = chunk.index, echo.kept(chunk)
            pieces[i].append(chunk.text)
            token_ids[i] += chunk.token_ids
            logprobs[i] += chunk.logprobs or []
            if chunk.finish_reason is not None:
                last[i] = chunk
                if all(c is not None for c in last):
                    break
            chunk = await _next(generation)
        usage = api.usage(
            prompt_tokens, sum(c.num_generated_tokens for c in last), _stages(last[0]),
            SpecCounts.total(c.spec for c in last),
            sum(c.num_cached_tokens for c in last[:: req.n]),
        )  # fmt: skip
        choices = []
        for i, c in enumerate(last):
            text = "".join(pieces[i])
            whole = dataclasses.replace(
                c, token_ids=token_ids[i], logprobs=logprobs[i] if c.logprobs is not None else None
            )
            lp = self._logprobs(req, whole, echo.offset(i))
            if req.kind == api.COMPLETIONS:
                choices.append(echo.choice(i, api.completion_choice(text, c.finish_reason, i, lp)))
                continue
            answer = output()
            answer.push(text, last=True)
            finish_reason = answer.finish_reason(c.finish_reason)
            choices.append(api.chat_choice(answer.message(), finish_reason, i, lp))
        if req.kind == api.COMPLETIONS:
            return JSONResponse(api.completions(head, choices, usage=usage))
        return JSONResponse(api.chat_completion(head, choices, usage))

    async def _events(
        self, req: api.OpenAIRequest, head: api.ResponseHead, generation: Choices, first: Chunk,
        output: Callable[[], ChatOutput], prompt_tokens: int, echo: Echoes,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """`_whole`'s arguments; the same answer as server-sent events."""
        chat, num = req.kind == api.CHAT, req.num_choices
        extra = {"usage": None} if req.include_usage else {}
        answers = [output() for _ in range(num)] if chat else []
        offsets = [
            echo.offset(i) for i in range(num)
        ]  # characters of each choice's text sent so far
        generated = [0] * num  # tokens of each choice so far
        last: list[Chunk | None] = [None] * num
        try:
            if chat:
                role = {"role": "assistant", "content": ""}
                if req.continuous_usage:
                    extra = {"usage": api.usage(prompt_tokens, 0)}
                for i in range(num):
                    yield _sse(api.chat_chunk(head, role, None, i, **extra))
            chunk = first
            while True:
                if (opening := echo.opening(chunk)) is not None:  # the choice's prompt first
                    yield _sse(api.completions(head, [opening], **extra))
                chunk = echo.kept(chunk)
                i, done, delta = chunk.index, chunk.finish_reason is not None, chunk.text
                logprobs = self._logprobs(req, chunk, offsets[i])
                offsets[i] += len(delta)
                if req.continuous_usage:  # the usage so far, every choice's tokens summed
                    generated[i] = chunk.num_generated_tokens
                    extra = {"usage": api.usage(prompt_tokens, sum(generated))}
                if chat:
                    body = answers[i].push(delta, done)
                    if body or logprobs is not None:
                        yield _sse(api.chat_chunk(head, body, None, i, logprobs, **extra))
                elif delta or logprobs is not None:
                    yield _sse(api.completion(head, delta, None, i, logprobs, **extra))
                if done:
                    last[i] = chunk
                    if chat:
                        reason = answers[i].finish_reason(chunk.finish_reason)
                        yield _sse(api.chat_chunk(head, {}, reason, i, **extra))
                    else:
                        yield _sse(api.completion(head, "", chunk.finish_reason, i, **extra))
                    if all(c is not None for c in last):
                        break
                chunk = await _next(generation)
            if req.include_usage:
                spec = SpecCounts.total(c.spec for c in last)
                usage = api.usage(
                    prompt_tokens, sum(c.num_generated_tokens for c in last), _stages(last[0]),
                    spec, sum(c.num_cached_tokens for c in last[:: req.n]),
                )  # fmt: skip
                yield _sse(api.usage_chunk(head, req.kind, usage))
        except (
            Exception
        ) as e:  # process boundary: the status line is sent, so the error is an event
            if not isinstance(e, PdserveError):
                logger.error("request %s failed", generation.request_id, exc_info=e)
            yield _sse(http_error_for(e).body())
        finally:
            generation.cancel()
        yield _DONE


async def _next(generation: Choices) -> Chunk:
    """The next chunk; an abort (the server shutting down) is an error here."""
    chunk = await anext(generation)
    if chunk.finish_reason == FinishReason.ABORT:
        raise UnavailableError(chunk.error or "the server is shutting down")
    return chunk
