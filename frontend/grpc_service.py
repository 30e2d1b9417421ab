"""The gRPC servicers, kept thin and peers of the HTTP server over `EngineClient`: `Generation` turns a request
into a `RequestInput` (`request_builder` checks it), submits it and turns its chunks into response messages;
`Admin` reports and changes the pools. Both are process boundaries: pdserve errors become status codes through
`errors.status_for`; anything else is logged with its traceback and returned as INTERNAL. A client's cancel is
ordinary: one INFO line, no traceback. A client that reads nothing of its stream (HTTP/2 flow control holds
the writes) for router.http_idle_timeout_s is cut: its request is cancelled at once, its call ended with
DEADLINE_EXCEEDED. `server_options` sets the transport's timeouts (slow handshakes, idle or vanished
connections). Request bytes that do not decode as the method's message get
INVALID_ARGUMENT (`add_servicers` registers the services with a deserializer that cannot raise).

Logs name a request by the router's internal id, never by the client's `request_id` (any bytes, any length)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from pdserve.cluster.pools import DECODE, PREFILL, ROLES
from pdserve.engine.grammar import check
from pdserve.engine.messages import SpecCounts
from pdserve.engine.sampling_params import STRUCTURED_KINDS, StructuredOutput, TokenLogprobs
from pdserve.frontend.engine_client import EngineClient, ServerStatus, Timings, WorkerInfo
from pdserve.frontend.errors import status_for
from pdserve.frontend.request_builder import RequestInput, build_request
from pdserve.frontend.validation import FieldNames, SamplingRequest, prompt_bytes_limit
from pdserve.model.errors import ConfigError, InvalidRequestError, PdserveError
from pdserve.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

if TYPE_CHECKING:
    from pdserve.cluster.config import RouterConfig
    from pdserve.frontend.validation import ModelInfo

logger = logging.getLogger(__name__)

_FINISH = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}
MAX_POOL_WORKERS = 1024
"""Most workers ScalePool grows a pool to: past any cluster pdserve serves (each worker holds at least one
GPU or CPU share), and each is launched at once, so a uint32 count is refused before anything starts."""
_ROLE = {PREFILL: admin_pb2.ROLE_PREFILL, DECODE: admin_pb2.ROLE_DECODE}
_ROLE_NAME = {v: k for k, v in _ROLE.items()}
_STATE = {
    "starting": admin_pb2.WORKER_STATE_STARTING,
    "serving": admin_pb2.WORKER_STATE_SERVING,
    "draining": admin_pb2.WORKER_STATE_DRAINING,
}


async def _abort(context: grpc.aio.ServicerContext, error: BaseException, what: str) -> None:
    """Ends the call with `error`'s status (context.abort raises: nothing after this runs)."""
    if not isinstance(error, PdserveError):
        logger.error("%s failed", what, exc_info=error)
    code, message = status_for(error)
    await context.abort(code, message)


GRPC_FIELDS = FieldNames(
    prompt_text="prompt",
    prompt_ids="prompt_token_ids",
    sampling_prefix="sampling_params.",
    max_tokens="sampling_params.max_tokens",
    logprobs="sampling_params.logprobs",
    n="sampling_params.n",
    stop="sampling_params.stop",
)
"""What errors call a GenerateRequest's fields."""


_OPTIONAL_SAMPLING = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "skip_special_tokens",
    "relaxed_acceptance", "prompt_logprobs",
)  # fmt: skip
"""SamplingParams fields a client may leave unset (None: the server's default), by the same names in
`SamplingRequest`."""


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


def _structured_output(
    kind: str, text: str, field: str, start_after: int | None = None
) -> StructuredOutput:
    if kind not in STRUCTURED_KINDS:
        raise InvalidRequestError(
            f"{field}.kind", f"expected one of {', '.join(STRUCTURED_KINDS)}, got {kind!r:.80}"
        )
    if kind == "choice":
        try:
            choices = json.loads(text)
        except ValueError:
            choices = None
        if not isinstance(choices, list):
            raise InvalidRequestError(f"{field}.text", "a choice's text is a JSON list of strings")
    return StructuredOutput(kind, text, start_after)


def _request_input(request: generation_pb2.GenerateRequest, deadline: float | None) -> RequestInput:
    """A GenerateRequest as `build_request` takes it (its text read here: a few ms per MiB, so off the loop
    for a long prompt)."""
    sp = request.sampling_params
    which = request.WhichOneof("input")
    structured = None
    if sp.HasField("structured_output"):
        field = "sampling_params.structured_output"
        given = sp.structured_output
        start_after = _optional(given, "start_after_token_id")
        structured = check(_structured_output(given.kind, given.text, field, start_after), field)
    sampling = SamplingRequest(
        **{name: _optional(sp, name) for name in _OPTIONAL_SAMPLING},
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        structured=structured,
    )
    return RequestInput(
        names=GRPC_FIELDS,
        client_id=request.request_id,
        prompt_text=request.prompt if which == "prompt" else None,
        prompt_ids=list(request.prompt_token_ids.ids) if which == "prompt_token_ids" else None,
        sampling=sampling,
        n=sp.n if sp.HasField("n") else 1,
        stop=list(sp.stop),
        deadline=deadline,
    )


class _ClientGone(Exception):
    """A response could not be written: the client cancelled the call or its connection went away."""


class _ClientStalled(Exception):
    """A response's write stayed blocked for the idle timeout: the client reads nothing of its stream."""


def server_options(router: RouterConfig) -> list[tuple[str, int]]:
    """The gRPC server's transport options from the router's timeouts: a connection must finish its handshake
    (TLS, HTTP/2 preface) within http_header_timeout_s; one with no call for http_idle_timeout_s is closed
    (GOAWAY); each connection is pinged every grpc_keepalive_s and closed when a ping goes unanswered that long
    (a vanished client). Clients may ping as often as every grpc_keepalive_s / 2 (gRPC's default allows one
    every 5 minutes; a client keepalive below that would be answered with GOAWAY)."""
    ms = lambda s: max(1, round(s * 1000))  # noqa: E731
    return [
        ("grpc.server_handshake_timeout_ms", ms(router.http_header_timeout_s)),
        ("grpc.max_connection_idle_ms", ms(router.http_idle_timeout_s)),
        ("grpc.keepalive_time_ms", ms(router.grpc_keepalive_s)),
        ("grpc.keepalive_timeout_ms", ms(router.grpc_keepalive_s)),
        # what closes the connection when a ping goes unanswered (keepalive_timeout_ms alone does not)
        ("grpc.http2.ping_timeout_ms", ms(router.grpc_keepalive_s)),
        ("grpc.http2.min_ping_interval_without_data_ms", ms(router.grpc_keepalive_s / 2)),
        ("grpc.http2.max_ping_strikes", 2),
    ]


def _timings(t: Timings) -> generation_pb2.Timings:
    return generation_pb2.Timings(
        queued_s=t.queued_s,
        time_to_first_token_s=t.time_to_first_token_s,
        total_s=t.total_s,
        num_preemptions=t.num_preemptions,
        prefill_worker=t.prefill_worker,
        decode_worker=t.decode_worker,
        **dataclasses.asdict(t.stages),
    )


def speculative_usage(spec: SpecCounts) -> generation_pb2.SpeculativeUsage:
    """A choice's speculation as `Usage.speculative` carries it."""
    return generation_pb2.SpeculativeUsage(
        draft_tokens=spec.drafted,
        accepted_tokens=spec.accepted,
        mean_accepted_length=spec.mean_accepted_length,
    )


def _logprob(lp: TokenLogprobs) -> generation_pb2.TokenLogprob:
    return generation_pb2.TokenLogprob(
        logprob=lp.logprob, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs, rank=lp.rank
    )


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: EngineClient, idle_s: float):
        self.engine = engine
        self.idle_s = idle_s
        """How long one response's write may stay blocked (router.http_idle_timeout_s)."""

    async def Generate(self, request: generation_pb2.GenerateRequest, context) -> None:
        engine = self.engine
        try:
            engine.check_ready()
            remaining = context.time_remaining()
            deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
            # Tokenizing a long text takes CPU: off the loop, other streams keep flowing meanwhile.
            checked = await asyncio.to_thread(
                lambda: build_request(
                    _request_input(request, deadline), engine.model, engine.limits
                )
            )
            generation = engine.submit(checked)
        except Exception as e:  # process boundary
            await _abort(context, e, "Generate")
        # The client's id is echoed (an empty one gets the internal id, so every chunk names its request).
        request_id = request.request_id or generation.request_id
        try:
            async for chunk in generation:
                response = generation_pb2.GenerateResponse(
                    request_id=request_id,
                    token_ids=chunk.token_ids,
                    text=chunk.text,
                    index=chunk.index,
                )
                if chunk.logprobs is not None:
                    response.logprobs.extend(_logprob(lp) for lp in chunk.logprobs)
                if chunk.prompt_logprobs is not None:
                    response.prompt_logprobs.extend(_logprob(lp) for lp in chunk.prompt_logprobs)
                if chunk.finish_reason is not None:
                    response.finish_reason = _FINISH[chunk.finish_reason]
                    response.usage.prompt_tokens = chunk.num_prompt_tokens
                    response.usage.completion_tokens = chunk.num_generated_tokens
                    response.usage.cached_tokens = chunk.num_cached_tokens
                    if chunk.spec is not None:
                        response.usage.speculative.CopyFrom(speculative_usage(chunk.spec))
                    response.timings.CopyFrom(_timings(chunk.timings))
                try:
                    await asyncio.wait_for(context.write(response), self.idle_s)
                except TimeoutError as e:
                    raise _ClientStalled from e
                except Exception as e:  # the call ended under the write: a cancel that raced it
                    raise _ClientGone from e
        except asyncio.CancelledError:  # the client cancelled (or its deadline passed): ordinary
            logger.info("request %s cancelled by the client", generation.request_id)
            raise
        except _ClientGone:
            logger.info("request %s cancelled by the client", generation.request_id)
        except _ClientStalled:
            logger.info(
                "gRPC client %s cut: it read nothing of request %s's stream for %gs "
                "(router.http_idle_timeout_s)", context.peer(), generation.request_id, self.idle_s,
            )  # fmt: skip
            generation.cancel()  # its pages are freed now, not once the client reads again
            # The status queues behind the unread responses: it is sent if the client reads again, and the
            # wait for it is bounded (the transport closes a vanished client's connection on its own).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the client read nothing of this stream for {self.idle_s:g}s "
                        "(router.http_idle_timeout_s); its request was cancelled",
                    ),
                    self.idle_s,
                )
        except Exception as e:  # process boundary
            await _abort(context, e, f"Generate {generation.request_id}")
        finally:
            generation.cancel()


def worker_status(w: WorkerInfo) -> admin_pb2.WorkerStatus:
    status = admin_pb2.WorkerStatus(
        worker_id=w.worker_id,
        role=_ROLE[w.role],
        state=_STATE.get(w.state, admin_pb2.WORKER_STATE_UNSPECIFIED),
        num_gpus=w.num_gpus,
        node_ip=w.node_ip,
        num_requests=w.num_requests,
        kv_pages_total=w.kv_pages_total,
        page_size=w.page_size,
    )
    s = w.stats
    if s is not None:
        status.kv_pages_used = s.pages_used
        if w.role == PREFILL:
            status.num_queued, status.queued_tokens = s.num_queued, s.queued_tokens
        else:
            status.num_running, status.num_waiting = s.num_running, s.num_waiting
            status.num_preemptions = s.num_preemptions
    return status


def pool_status(status: ServerStatus, role: str) -> admin_pb2.PoolStatus:
    return admin_pb2.PoolStatus(
        role=_ROLE[role], workers=[worker_status(w) for w in status.workers[role]]
    )


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, engine: EngineClient):
        self.engine = engine

    async def GetStatus(self, request, context) -> admin_pb2.GetStatusResponse:
        try:
            status = await self.engine.status()
            return admin_pb2.GetStatusResponse(
                model=status.model,
                pools=[pool_status(status, role) for role in ROLES],
                num_requests=status.num_requests,
                output_tokens_per_s=status.output_tokens_per_s,
                uptime_s=status.uptime_s,
                aggregated=status.aggregated,
                kv_cache_dtype=status.kv_cache_dtype,
                lost_workers=[
                    admin_pb2.LostWorker(**{**dataclasses.asdict(x), "role": _ROLE[x.role]})
                    for x in status.lost_workers
                ],
                num_workers_lost=status.num_workers_lost,
                num_workers_replaced=status.num_workers_replaced,
                num_requests_migrated=status.num_requests_migrated,
                restarts_stopped=status.restarts_stopped,
                endpoints=[admin_pb2.Endpoint(**dataclasses.asdict(e)) for e in status.endpoints],
            )
        except Exception as e:  # process boundary
            await _abort(context, e, "GetStatus")

    async def ScalePool(self, request, context) -> admin_pb2.ScalePoolResponse:
        try:
            role = _ROLE_NAME.get(request.role)
            if role is None:
                raise ConfigError("role: expected ROLE_PREFILL or ROLE_DECODE")
            if request.count > MAX_POOL_WORKERS:
                raise ConfigError(
                    f"count: {request.count} workers; a pool is scaled to at most {MAX_POOL_WORKERS}"
                )
            added, removed = await self.engine.scale(role, request.count)
            status = await self.engine.status()
            return admin_pb2.ScalePoolResponse(
                added=added, removed=removed, pool=pool_status(status, role)
            )
        except Exception as e:  # process boundary
            await _abort(context, e, "ScalePool")

    async def DrainWorker(self, request, context) -> admin_pb2.DrainWorkerResponse:
        try:
            drained = await self.engine.drain(request.worker_id)
            return admin_pb2.DrainWorkerResponse(
                worker_id=request.worker_id, num_requests_drained=drained
            )
        except Exception as e:  # process boundary
            await _abort(context, e, "DrainWorker")


@dataclasses.dataclass(frozen=True, slots=True)
class _Undecodable:
    """What a request's bytes became when they did not parse as the method's message."""

    message: str


def message_limit(router: RouterConfig, model: ModelInfo | None = None) -> tuple[int, str]:
    """The largest request message read, and what sets it: router.max_message_bytes, or by default the most
    prompt text worth reading (`prompt_bytes_limit`; router.max_prompt_bytes without a model) plus 1 MiB."""
    if router.max_message_bytes is not None:
        return router.max_message_bytes, "router.max_message_bytes"
    if model is None:
        text, what = router.max_prompt_bytes, "router.max_prompt_bytes"
    else:
        text, what = prompt_bytes_limit(router, model)
    return text + (1 << 20), f"{what}, plus 1 MiB; router.max_message_bytes sets it"


def _lenient(
    parse: Callable[[bytes], Any], type_name: str, limit: tuple[int, str]
) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: grpc deserializes before calling the servicer and would
    answer UNKNOWN (with a logged traceback) to bytes that do not parse. A message over `limit` (bytes, and
    what sets them) is not parsed at all."""
    max_bytes, what = limit

    def deserialize(data: bytes) -> Any:
        if len(data) > max_bytes:
            return _Undecodable(
                f"a {type_name} of {len(data)} bytes; this server reads at most {max_bytes} ({what})"
            )
        try:
            return parse(data)
        except Exception as e:  # any parse failure is the client's bad bytes
            return _Undecodable(f"cannot be decoded as {type_name}: {e}")

    return deserialize


def _refusing_undecodable(behavior: Callable) -> Callable:
    """The servicer method, preceded by INVALID_ARGUMENT for a request that did not decode."""

    @functools.wraps(behavior)
    async def run(request, context):
        if isinstance(request, _Undecodable):
            logger.debug("refused undecodable request bytes: %s", request.message)
            code, message = status_for(InvalidRequestError("request", request.message))
            await context.abort(code, message)
        return await behavior(request, context)

    return run


def _reading_within(behavior: Callable, name: str, body_s: float) -> Callable:
    """The unary-request servicer method as a stream-request one (the same bytes on the wire) that reads its
    one request message within `body_s` (router.http_body_timeout_s): gRPC itself waits for a message
    forever, so a client that trickles its request, keeping its connection alive, would hold the call."""

    @functools.wraps(behavior)
    async def run(request_iterator, context):
        try:
            request = await asyncio.wait_for(context.read(), body_s)
        except TimeoutError:
            logger.info(
                "gRPC %s from %s: cut, its request message did not arrive within %.0f s "
                "(router.http_body_timeout_s)", name, context.peer(), body_s,
            )  # fmt: skip
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request message did not arrive within {body_s:g} s (router.http_body_timeout_s)",
            )
        if request is grpc.aio.EOF:
            code, message = status_for(
                InvalidRequestError("request", "no request message was sent")
            )
            await context.abort(code, message)
        return await behavior(request, context)

    return run


class _LenientRegistry:
    """Stands for the grpc server while a generated `add_*Servicer_to_server` registers its handlers, and
    registers them on the real server with `_lenient` deserializers, each read within the body timeout
    (`_reading_within`)."""

    def __init__(self, server: grpc.aio.Server, limit: tuple[int, str], body_s: float):
        self.server, self.limit, self.body_s = server, limit, body_s

    def _mend(self, handlers: dict[str, grpc.RpcMethodHandler]) -> dict[str, grpc.RpcMethodHandler]:
        mended = {}
        for name, h in handlers.items():
            kind = "unary_stream" if h.response_streaming else "unary_unary"
            behavior = getattr(h, kind)
            assert not h.request_streaming and inspect.iscoroutinefunction(behavior), name
            parse = h.request_deserializer
            type_name = getattr(parse, "__qualname__", "the request").removesuffix(".FromString")
            streamed = "stream_stream" if h.response_streaming else "stream_unary"
            mended[name] = h._replace(
                request_streaming=True,
                request_deserializer=_lenient(parse, type_name, self.limit),
                **{
                    kind: None,
                    streamed: _reading_within(_refusing_undecodable(behavior), name, self.body_s),
                },
            )
        return mended

    def add_generic_rpc_handlers(self, handlers) -> None:
        """Generated code passes the same handlers to `add_registered_method_handlers` next."""

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        handlers = self._mend(handlers)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, handlers),)
        )
        self.server.add_registered_method_handlers(service, handlers)


def add_servicers(engine: EngineClient, grpc_server: grpc.aio.Server) -> None:
    """Registers the Generation and Admin servicers over `engine` on `grpc_server`."""
    registry = _LenientRegistry(
        grpc_server, message_limit(engine.limits, engine.model), engine.limits.http_body_timeout_s
    )
    generation = GenerationServicer(engine, engine.limits.http_idle_timeout_s)
    generation_pb2_grpc.add_GenerationServicer_to_server(generation, registry)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(engine), registry)
