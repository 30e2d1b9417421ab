"""A small synchronous client of the pdserve gRPC API, used by `pdserve generate|status|scale|drain`, the demo
and the serving benchmark. Any gRPC client built from protos/pdserve/v1/*.proto works the same way."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.model.errors import PdserveError
from pdserve.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

ROLES = {"prefill": admin_pb2.ROLE_PREFILL, "decode": admin_pb2.ROLE_DECODE}
FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}


def generate_request(
    prompt: str | Sequence[int], *, request_id: str = "", max_tokens: int | None = None,
    temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
    min_p: float | None = None, seed: int | None = None, stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False, stop: Sequence[str] = (), presence_penalty: float | None = None,
    frequency_penalty: float | None = None, repetition_penalty: float | None = None,
    min_tokens: int | None = None, logprobs: int | None = None,
    skip_special_tokens: bool | None = None, n: int | None = None,
    relaxed_acceptance: bool | None = None,
) -> generation_pb2.GenerateRequest:  # fmt: skip
    """A GenerateRequest; None leaves a sampling field unset (the model's or the server's default)."""
    sp = generation_pb2.SamplingParams(
        stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, stop=list(stop)
    )
    for name, value in (
        ("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
        ("top_k", top_k), ("min_p", min_p), ("seed", seed), ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty), ("repetition_penalty", repetition_penalty),
        ("min_tokens", min_tokens), ("logprobs", logprobs),
        ("skip_special_tokens", skip_special_tokens), ("n", n),
        ("relaxed_acceptance", relaxed_acceptance),
    ):  # fmt: skip
        if value is not None:
            setattr(sp, name, value)
    request = generation_pb2.GenerateRequest(request_id=request_id, sampling_params=sp)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.ids.extend(prompt)
    return request


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise PdserveError(f"{flag} {path}: cannot read ({e.strerror})") from e


class Client:
    """`key` goes with every call as `authorization: Bearer KEY` (the API key for generation, the admin key for
    status, scale and drain). `tls_ca` (the server's CA, PEM; "" for the system's roots) makes the channel TLS;
    `tls_cert` and `tls_key` add a client certificate (mutual TLS)."""

    def __init__(
        self, address: str = "127.0.0.1:50051", *, key: str | None = None,
        tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
    ):  # fmt: skip
        self.address = address
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()
        if tls_ca is None and tls_cert is None:
            self.channel = grpc.insecure_channel(address)
        else:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca or None, "--tls-ca"),
                private_key=_read(tls_key, "--tls-key"),
                certificate_chain=_read(tls_cert, "--tls-cert"),
            )
            self.channel = grpc.secure_channel(address, credentials)
        self.generation = generation_pb2_grpc.GenerationStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def generate(
        self, request: generation_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """Streams the response chunks (the call is cancelled if the iterator is closed early)."""
        return self.generation.Generate(request, timeout=timeout_s, metadata=self.metadata)

    def is_serving(self, timeout_s: float = 5.0) -> bool:
        try:
            reply = self.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, metadata=self.metadata
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def wait_until_serving(self, timeout_s: float) -> None:
        """Blocks until health says SERVING; raises TimeoutError naming the address otherwise."""
        deadline = time.monotonic() + timeout_s
        while not self.is_serving():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.address} was not SERVING within {timeout_s:g}s")
            time.sleep(0.2)

    def status(self, timeout_s: float = 30.0) -> admin_pb2.GetStatusResponse:
        return self.admin.GetStatus(
            admin_pb2.GetStatusRequest(), timeout=timeout_s, metadata=self.metadata
        )

    def scale(
        self, role: str, count: int, timeout_s: float | None = None
    ) -> admin_pb2.ScalePoolResponse:
        request = admin_pb2.ScalePoolRequest(role=ROLES[role], count=count)
        return self.admin.ScalePool(request, timeout=timeout_s, metadata=self.metadata)

    def drain(
        self, worker_id: str, timeout_s: float | None = None
    ) -> admin_pb2.DrainWorkerResponse:
        request = admin_pb2.DrainWorkerRequest(worker_id=worker_id)
        return self.admin.DrainWorker(request, timeout=timeout_s, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def format_status(status: admin_pb2.GetStatusResponse) -> str:
    """A table of the pools for the terminal, then what the server listens on."""
    lines = [
        f"model {status.model}  requests {status.num_requests}  {status.output_tokens_per_s:.1f} tok/s  "
        f"uptime {status.uptime_s:.0f}s  KV rows {status.kv_cache_dtype or 'auto'}"
        f"{'  (aggregated)' if status.aggregated else ''}",
        f"{'worker':<12}{'state':<10}{'node':<16}{'gpus':>5}{'reqs':>6}{'queued':>8}{'q.tokens':>10}"
        f"{'running':>9}{'waiting':>9}{'KV pages':>18}",
    ]
    for pool in status.pools:
        for w in pool.workers:
            state = admin_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
            used = f"{w.kv_pages_used}/{w.kv_pages_total}"
            lines.append(
                f"{w.worker_id:<12}{state:<10}{w.node_ip:<16}{w.num_gpus:>5}{w.num_requests:>6}"
                f"{w.num_queued:>8}{w.queued_tokens:>10}{w.num_running:>9}{w.num_waiting:>9}{used:>18}"
            )
    if status.num_workers_lost:
        lines.append(
            f"lost workers {status.num_workers_lost}, replaced {status.num_workers_replaced}, "
            f"requests migrated {status.num_requests_migrated}"
        )
    for w in status.lost_workers:
        if w.replaced_by:
            fate = f"replaced by {w.replaced_by}"
        elif w.not_replaced:
            fate = f"not replaced: {w.not_replaced}"
        else:
            fate = "replacement starting" + (
                f" (last try failed: {w.replacement_error})" if w.replacement_error else ""
            )
        lines.append(
            f"{w.worker_id:<12}{'lost':<10}{w.lost_s_ago:.0f}s ago, {w.num_requests_migrated} requests "
            f"migrated, {fate}; {w.reason}"
        )
    if status.restarts_stopped:
        lines.append(status.restarts_stopped)
    if status.endpoints:
        lines.append(f"{'listening':<12}{'address':<24}{'TLS':<12}needs")
        for e in status.endpoints:
            lines.append(f"{e.name:<12}{e.address:<24}{e.tls:<12}{e.auth}")
    return "\n".join(lines)
