"""The gRPC servicers, kept thin: `Generation` turns a request into a router stream and the stream into response
chunks; `Admin` reports and changes the pools. Both are process boundaries: pdserve errors become status codes
through `errors.status_for`; anything else is logged with its traceback and returned as INTERNAL."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING

import grpc

from pdserve.model.errors import ConfigError, PdserveError
from pdserve.model.tokenizer import IncrementalDetokenizer
from pdserve.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from .errors import UnavailableError, status_for
from .pools import DECODE, PREFILL, ROLES, WorkerHandle
from .router import Request
from .validation import parse_request

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
            prompt_ids, params = parse_request(request, server.model, server.config.router)
            remaining = context.time_remaining()
            deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
            request_id = request.request_id or uuid.uuid4().hex
            r = server.router.open(request_id, prompt_ids, params, deadline)
        except Exception as e:  # process boundary
            await _abort(context, e, "Generate")
        tokenizer = server.model.tokenizer
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer else None
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
                await context.write(response)
        except Exception as e:  # process boundary
            await _abort(context, e, f"Generate {request_id}")
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
