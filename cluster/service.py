"""The gRPC servicers, kept thin: `Generation` turns a request into a router stream and the stream into response
chunks; `Admin` reports and changes the pools. Both are process boundaries: pdserve errors become status codes
through `errors.status_for`; anything else is logged with its traceback and returned as INTERNAL. A client's
cancel is ordinary: one INFO line, no traceback. Request bytes that do not decode as the method's message get
INVALID_ARGUMENT (`add_servicers` registers the services with a deserializer that cannot raise).

Logs name a request by the router's internal id, never by the client's `request_id` (any bytes, any length)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from pdserve.model.errors import ConfigError, InvalidRequestError, PdserveError
from pdserve.model.tokenizer import IncrementalDetokenizer
from pdserve.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from .errors import UnavailableError, status_for
from .pools import DECODE, PREFILL, ROLES, WorkerHandle
from .router import Request
from .validation import check_request_id, parse_request

if TYPE_CHECKING:
    from .server import PdServer

logger = logging.getLogger(__name__)

_FINISH = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}
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


class _ClientGone(Exception):
    """A response could not be written: the client cancelled the call or its connection went away."""


def _timings(r: Request) -> generation_pb2.Timings:
    def since_arrival(t: float | None) -> float:
        return 0.0 if t is None else t - r.arrival

    return generation_pb2.Timings(
        queued_s=since_arrival(r.admitted_at),
        time_to_first_token_s=since_arrival(r.first_token_at),
        total_s=since_arrival(r.finished_at),
        num_preemptions=r.num_preemptions,
        prefill_worker=r.prefill_worker,
        decode_worker=r.decode_worker,
    )


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, server: PdServer):
        self.server = server

    async def Generate(self, request: generation_pb2.GenerateRequest, context) -> None:
        server = self.server
        try:
            if not server.serving:
                raise UnavailableError("the workers are not serving yet (or shutting down)")
            check_request_id(request.request_id)
            prompt_ids, params = parse_request(request, server.model, server.config.router)
            remaining = context.time_remaining()
            deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
            r = server.router.open(request.request_id, prompt_ids, params, deadline)
        except Exception as e:  # process boundary
            await _abort(context, e, "Generate")
        tokenizer = server.model.tokenizer
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer else None
        # The client's id is echoed (an empty one gets the internal id, so every chunk names its request).
        request_id = request.request_id or r.request_id
        try:
            while (out := await server.router.next_tokens(r)) is not None:
                response = generation_pb2.GenerateResponse(
                    request_id=request_id,
                    token_ids=out.token_ids,
                    text=detokenizer.push(out.token_ids) if detokenizer else "",
                )
                if out.finish_reason is not None:
                    response.finish_reason = _FINISH[out.finish_reason]
                    response.usage.prompt_tokens = len(prompt_ids)
                    response.usage.completion_tokens = len(r.generated)
                    response.timings.CopyFrom(_timings(r))
                try:
                    await context.write(response)
                except Exception as e:  # the call ended under the write: a cancel that raced it
                    raise _ClientGone from e
        except asyncio.CancelledError:  # the client cancelled (or its deadline passed): ordinary
            logger.info("request %s cancelled by the client", r.request_id)
            raise
        except _ClientGone:
            logger.info("request %s cancelled by the client", r.request_id)
        except Exception as e:  # process boundary
            await _abort(context, e, f"Generate {r.request_id}")
        finally:
            server.router.close(r)


def worker_status(w: WorkerHandle) -> admin_pb2.WorkerStatus:
    status = admin_pb2.WorkerStatus(
        worker_id=w.worker_id,
        role=_ROLE[w.role],
        state=_STATE.get(w.state, admin_pb2.WORKER_STATE_UNSPECIFIED),
        num_gpus=w.num_gpus,
        node_ip=w.node_ip,
        num_requests=len(w.requests),
        kv_pages_total=w.num_pages,
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


def pool_status(server: PdServer, role: str) -> admin_pb2.PoolStatus:
    workers = sorted(server.router.pool(role), key=lambda w: w.worker_id)
    return admin_pb2.PoolStatus(role=_ROLE[role], workers=[worker_status(w) for w in workers])


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, server: PdServer):
        self.server = server

    async def GetStatus(self, request, context) -> admin_pb2.GetStatusResponse:
        server = self.server
        try:
            await server.refresh_stats()
            return admin_pb2.GetStatusResponse(
                model=str(server.model_dir),
                pools=[pool_status(server, role) for role in ROLES],
                num_requests=len(server.router.requests),
                output_tokens_per_s=server.output_tokens_per_s,
                uptime_s=server.uptime_s,
                aggregated=not server.router.pool(PREFILL),
                kv_cache_dtype=server.config.model.kv_cache_dtype,
            )
        except Exception as e:  # process boundary
            await _abort(context, e, "GetStatus")

    async def ScalePool(self, request, context) -> admin_pb2.ScalePoolResponse:
        server = self.server
        try:
            role = _ROLE_NAME.get(request.role)
            if role is None:
                raise ConfigError("role: expected ROLE_PREFILL or ROLE_DECODE")
            added, removed = await server.scaler.scale(role, request.count)
            await server.refresh_stats()
            return admin_pb2.ScalePoolResponse(
                added=added, removed=removed, pool=pool_status(server, role)
            )
        except Exception as e:  # process boundary
            await _abort(context, e, "ScalePool")

    async def DrainWorker(self, request, context) -> admin_pb2.DrainWorkerResponse:
        try:
            drained = await self.server.scaler.drain(request.worker_id)
            return admin_pb2.DrainWorkerResponse(
                worker_id=request.worker_id, num_requests_drained=drained
            )
        except Exception as e:  # process boundary
            await _abort(context, e, "DrainWorker")


@dataclasses.dataclass(frozen=True, slots=True)
class _Undecodable:
    """What a request's bytes became when they did not parse as the method's message."""

    message: str


def _lenient(parse: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: grpc deserializes before calling the servicer and would
    answer UNKNOWN (with a logged traceback) to bytes that do not parse."""

    def deserialize(data: bytes) -> Any:
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


class _LenientRegistry:
    """Stands for the grpc server while a generated `add_*Servicer_to_server` registers its handlers, and
    registers them on the real server with `_lenient` deserializers."""

    def __init__(self, server: grpc.aio.Server):
        self.server = server

    @staticmethod
    def _mend(handlers: dict[str, grpc.RpcMethodHandler]) -> dict[str, grpc.RpcMethodHandler]:
        mended = {}
        for name, h in handlers.items():
            kind = "unary_stream" if h.response_streaming else "unary_unary"
            behavior = getattr(h, kind)
            assert not h.request_streaming and inspect.iscoroutinefunction(behavior), name
            parse = h.request_deserializer
            type_name = getattr(parse, "__qualname__", "the request").removesuffix(".FromString")
            mended[name] = h._replace(
                request_deserializer=_lenient(parse, type_name),
                **{kind: _refusing_undecodable(behavior)},
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


def add_servicers(server: PdServer, grpc_server: grpc.aio.Server) -> None:
    """Registers the Generation and Admin servicers of `server` on `grpc_server`."""
    registry = _LenientRegistry(grpc_server)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(server), registry)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(server), registry)
