"""The serving process: joins (or starts) Ray, hosts the KV store, starts the gRPC server (Generation, Admin,
grpc.health.v1, reflection) and the OpenAI-compatible HTTP server, brings up the pools, and logs a startup
summary and a stats line every few seconds. Health is NOT_SERVING (HTTP /health: 503) until every worker is
warm, and again from the start of a shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import socket
import threading
import time

import grpc
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.cluster import placement
from pdserve.cluster.config import ServeConfig
from pdserve.cluster.pools import DECODE, PREFILL, Launcher, WorkerState
from pdserve.cluster.ray_connect import is_loopback, ray_auth
from pdserve.cluster.router import Router
from pdserve.cluster.scaling import Scaler
from pdserve.cluster.supervisor import Supervisor
from pdserve.engine import messages
from pdserve.engine.messages import DecodeStats, PrefillStats
from pdserve.frontend.engine_client import EndpointInfo
from pdserve.frontend.grpc_service import add_servicers, message_limit, server_options
from pdserve.frontend.http_server import HttpFrontEnd
from pdserve.frontend.ray_engine import RayEngineClient
from pdserve.frontend.security import (
    Credentials,
    KeyInterceptor,
    check_exposure,
    grpc_server_credentials,
    http_ssl_options,
    open_doors_warning,
)
from pdserve.frontend.validation import ModelInfo
from pdserve.kvtransfer import KVTransferConfig
from pdserve.kvtransfer.store import host_store, new_secret
from pdserve.model.errors import ConfigError
from pdserve.model.loader import plan_load
from pdserve.model.random_checkpoint import resolve_model
from pdserve.protos import SERVICE_NAMES

logger = logging.getLogger("pdserve.server")

HEALTH_SERVICES = ("", "pdserve.v1.Generation")
_REFRESH_S = 1.0
_IDLE_LOG_S = 60.0
_STATS_TIMEOUT_S = 5.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int, flag: str) -> None:
    """Raises ConfigError when nothing could listen on host:port now (port 0 always passes). gRPC binds with
    SO_REUSEPORT, so its own bind would not fail on a port another gRPC server holds: a plain bind tells."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(
                f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror})"
            ) from e


class PdServer:
    """One serving deployment. `start` and `stop` run on the event loop the server lives on."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.serving = False
        self.port = 0
        self.http_port = 0
        """The OpenAI-compatible HTTP port once started (0: HTTP is off)."""
        self.metrics_port = 0
        """The metrics-only port once started (0: none)."""
        self._started_at = time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self._rate = (time.monotonic(), 0)
        self.output_tokens_per_s = 0.0

    @property
    def address(self) -> str:
        return f"{self._connect_host}:{self.port}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL (empty when HTTP is off)."""
        if not self.http_port:
            return ""
        return f"{self._http_scheme}://{self._connect_host}:{self.http_port}/v1"

    @property
    def _http_scheme(self) -> str:
        return "https" if self.config.security.tls_cert else "http"

    @property
    def _connect_host(self) -> str:
        host = self.config.router.host
        return "127.0.0.1" if host in ("0.0.0.0", "::") else host

    def endpoints(self) -> list[EndpointInfo]:
        """What this server listens on (once started), each with what a caller needs (`pdserve status`)."""
        config, host = self.config, self.config.router.host
        tls = "none"
        if config.security.tls_cert is not None:
            tls = "mutual TLS" if config.security.tls_client_ca else "TLS"
        generation = self.credentials.generation_auth
        if self.credentials.open:
            admin = "none"
        else:
            admin = "admin key" if self.credentials.admin is not None else "refused (no admin key)"
        found = [EndpointInfo("gRPC", f"{host}:{self.port}", f"{generation}; Admin: {admin}", tls)]
        if self.http_port:
            found.append(EndpointInfo("HTTP", f"{host}:{self.http_port}", generation, tls))
        if self.metrics_port:
            found.append(EndpointInfo("metrics", f"{host}:{self.metrics_port}", generation, tls))
        if hasattr(self, "_store"):
            found.append(EndpointInfo(
                "KV store", f"{self._store_host}:{self._store.port}",
                "none (keys under a secret prefix the workers get through Ray)", "none",
            ))  # fmt: skip
        if ray.is_initialized():
            gcs = ray.get_runtime_context().gcs_address
            found.append(EndpointInfo("Ray", gcs, ray_auth(), "none"))
        return found

    def _kv_config(self) -> KVTransferConfig:
        """The store address workers get: where it listens (`_host_store`) and the port it got."""
        return dataclasses.replace(
            self.config.kvtransfer, store_host=self._store_host, store_port=self._store.port
        )

    def _store_bind_host(self) -> str | None:
        """Where the KV store listens: store_host as configured, unless it is loopback and this server joins
        a Ray cluster (whose workers may be on other nodes, now or once it grows): then this node's own
        address, known once Ray is up (None until then)."""
        host = self.config.kvtransfer.store_host
        address = self.config.cluster.ray_address or os.environ.get("RAY_ADDRESS") or "local"
        if host not in _LOOPBACK or address == "local":
            return host
        return ray.util.get_node_ip_address() if ray.is_initialized() else None

    def _host_store(self) -> None:
        """Hosts the KV store on `_store_bind_host` (idempotent; a no-op until that is known)."""
        if hasattr(self, "_store"):
            return
        host = self._store_bind_host()
        if host is None:
            return
        port = self.config.kvtransfer.store_port
        try:
            self._store = host_store(host, port, self.config.kvtransfer.connect_timeout_s)
        except OSError as e:
            raise ConfigError(
                f"--kvtransfer.store-port {port}: cannot host the KV store on {host} ({e.strerror}; "
                "another pdserve serve?); leave it unset (0) for a free port"
            ) from e
        self._store_host = host
        self.store_secret = new_secret()
        """The key that signs every value the workers put in the KV store (`kvtransfer.store.SignedStore`): handed to
        them through Ray, never written to the store."""

    def prepare(self) -> None:
        """What needs no Ray, done before Ray starts so that a mistake fails in a second rather than after
        Ray's start-up: the checkpoint (config.json against the shards' headers; no tensor data is read), keys
        and TLS files, a key for a --host beyond loopback (`check_exposure`), the gRPC port free, the KV store
        hosted (on a free port unless one is configured; when joining a Ray cluster, `start` hosts it on this
        node's address). Idempotent."""
        if hasattr(self, "model"):
            self._host_store()
            return
        config = self.config
        self.model_dir = resolve_model(config.model.path)
        if config.model.load_format == "safetensors":  # dummy weights need config.json alone
            plan_load(self.model_dir)
        self.model = ModelInfo.load(self.model_dir, config.model.path)
        self.credentials = Credentials.resolve(config.security)
        check_exposure(config.router.host, self.credentials, config.security)
        self._grpc_tls = grpc_server_credentials(config.security)
        self._http_tls = http_ssl_options(config.security)
        check_port_free(config.router.host, config.router.port, "--port")
        if config.router.http_port is not None:
            check_port_free(config.router.host, config.router.http_port, "--http-port")
        if config.router.metrics_port is not None:
            check_port_free(config.router.host, config.router.metrics_port, "--router.metrics-port")
        self._host_store()

    async def start(self) -> None:
        config = self.config
        await asyncio.to_thread(self.prepare)
        kv = self._kv_config()
        gpus = placement.resolve_gpus_per_worker(
            config.cluster.gpus_per_worker, ray.cluster_resources()
        )
        self.router = Router(config.router, replay_on_decode=config.model.batch_invariant)
        self.router.on_workers_changed = self._update_health
        launcher = Launcher(config, kv, gpus, self.store_secret)
        self.scaler = Scaler(config, self.router, launcher, self.model.bos_token_id)
        self.supervisor = Supervisor(config.router, self.router, self.scaler, launcher)
        self.engine = RayEngineClient(
            self.router, self.scaler, self.supervisor, self.model, config.router,
            model_dir=str(self.model_dir), kv_cache_dtype=config.model.kv_cache_dtype,
            started_at=self._started_at, ready=lambda: self.serving,
            refresh_stats=self.refresh_stats, endpoints=self.endpoints,
        )  # fmt: skip
        """What both front ends are handed (`EngineClient`)."""
        await self._start_grpc()
        await self._start_http()
        await self._start_metrics()
        open_doors = open_doors_warning(
            config.router.host, self.credentials, config.security,
            [
                f"{e.name} {e.address}" for e in self.endpoints()
                if e.auth.startswith("none") and not is_loopback(e.address.rsplit(":", 1)[0])
            ],
        )  # fmt: skip
        if open_doors:
            logger.warning("%s", open_doors)
        logger.info(
            "starting %d prefill and %d decode workers (%d GPUs each) for %s",
            config.cluster.num_prefill, config.cluster.num_decode, gpus, self.model_dir,
        )  # fmt: skip
        await self.scaler.start(config.cluster.num_prefill, config.cluster.num_decode)
        # What start-up built (modules, the tokenizer, Ray's state) lives as long as the process: frozen out of
        # the collector's reach, a full collection scans only what requests made since, instead of pausing the
        # event loop (both front ends, every stream) to scan all of it.
        gc.collect()
        gc.freeze()
        self.serving = True
        await self._set_health(True)
        self._tasks.append(asyncio.create_task(self._refresh_loop(), name="stats"))
        self._tasks.append(asyncio.create_task(self.supervisor.watch(), name="heartbeats"))
        self._log_summary(gpus)

    async def _start_grpc(self) -> None:
        router_config = self.config.router
        # gRPC itself refuses past twice the configured limit, unread; below that, the servicers'
        # deserializer refuses what is over the limit (or can never fit the context) naming it, unparsed.
        receive_limit = 2 * message_limit(router_config)[0]
        self.grpc_server = grpc.aio.server(
            interceptors=[KeyInterceptor(self.credentials)],
            options=[
                ("grpc.max_receive_message_length", receive_limit),
                *server_options(router_config),
            ],
        )
        add_servicers(self.engine, self.grpc_server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        await self._set_health(False)
        names = (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.grpc_server)
        target = f"{router_config.host}:{router_config.port}"
        try:
            if self._grpc_tls is None:
                self.port = self.grpc_server.add_insecure_port(target)
            else:
                self.port = self.grpc_server.add_secure_port(target, self._grpc_tls)
        except RuntimeError as e:
            raise ConfigError(f"cannot listen on {target}: {e} (port in use? set --port)") from e
        await self.grpc_server.start()
        logger.info(
            "gRPC listening on %s:%d%s (health: NOT_SERVING until the workers are warm); %s",
            router_config.host, self.port, self._tls_note, self.credentials.describe(),
        )  # fmt: skip

    @property
    def _tls_note(self) -> str:
        if self._grpc_tls is None:
            return ""
        return " with mutual TLS" if self.config.security.tls_client_ca else " with TLS"

    async def _start_http(self) -> None:
        router_config = self.config.router
        if router_config.http_port is None:
            return
        self.http = HttpFrontEnd(
            self.engine, router_config.reasoning_parser, credentials=self.credentials
        )
        try:
            self.http_port = await self.http.start(
                router_config.host, router_config.http_port, router_config.shutdown_grace_s,
                self._http_tls,
            )  # fmt: skip
        except OSError as e:
            raise ConfigError(
                f"--http-port {router_config.http_port}: cannot listen on {router_config.host} ({e.strerror})"
            ) from e
        logger.info(
            "OpenAI-compatible HTTP listening on %s://%s:%d/v1 (/health: 503 until the workers are warm)",
            self._http_scheme, router_config.host, self.http_port,
        )  # fmt: skip

    async def _start_metrics(self) -> None:
        router_config = self.config.router
        if router_config.metrics_port is None:
            return
        self.metrics_http = HttpFrontEnd(
            self.engine, "none", metrics_only=True, credentials=self.credentials
        )
        try:
            self.metrics_port = await self.metrics_http.start(
                router_config.host, router_config.metrics_port, 0.0, self._http_tls
            )
        except OSError as e:
            raise ConfigError(
                f"--router.metrics-port {router_config.metrics_port}: cannot listen on "
                f"{router_config.host} ({e.strerror})"
            ) from e
        logger.info(
            "Prometheus metrics on %s://%s:%d/metrics",
            self._http_scheme, router_config.host, self.metrics_port,
        )  # fmt: skip

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in HEALTH_SERVICES:
            await self.health.set(name, status)

    def _update_health(self) -> None:
        if self.serving:
            up = bool(self.router.pool(DECODE, WorkerState.SERVING))
            asyncio.get_running_loop().create_task(self._set_health(up))

    def _log_summary(self, gpus: int) -> None:
        decodes = self.router.pool(DECODE)
        kv = ", ".join(f"{w.worker_id} {w.num_pages * w.page_size} tokens" for w in decodes)
        kv += f" ({self.config.model.kv_cache_dtype} rows)"
        mode = (
            "aggregated (decode workers prefill)"
            if not self.router.pool(PREFILL)
            else "disaggregated"
        )
        logger.info(
            "serving %s on %s: %d prefill + %d decode workers, %s, %s; KV capacity per decode worker: %s",
            self.model_dir, self.address, len(self.router.pool(PREFILL)), len(decodes),
            ", ".join(f"{w.worker_id} {w.num_gpus} GPU(s)" for w in self.router.workers.values())
            if gpus else "CPU", mode, kv,
        )  # fmt: skip

    async def refresh_stats(self) -> float:
        """Fetches every worker's stats (bounded wait); they steer admission and feed status and logs. The
        answers are heartbeats, and tell the step each worker runs (`Supervisor.watch` declares stalled ones
        lost); a dead actor is lost at once. Returns `output_tokens_per_s`."""
        workers = [w for w in self.router.workers.values() if w.state != WorkerState.DEAD]
        calls = [asyncio.wait_for(w.actor.stats.remote(), _STATS_TIMEOUT_S) for w in workers]
        for w, result in zip(
            workers, await asyncio.gather(*calls, return_exceptions=True), strict=True
        ):
            if isinstance(result, bytes):
                w.stats = messages.unwrap(
                    PrefillStats if w.role == PREFILL else DecodeStats, result
                )
                w.reserved_pages = 0
                w.last_heartbeat = time.monotonic()
            elif isinstance(
                result, ray.exceptions.ActorDiedError
            ):  # unreachable: the heartbeat tells
                self.router.worker_lost(w, str(result).splitlines()[0])
        now, tokens = time.monotonic(), self.router.num_output_tokens
        then, before = self._rate
        if now - then >= _REFRESH_S:
            self.output_tokens_per_s = (tokens - before) / (now - then)
            self._rate = (now, tokens)
        return self.output_tokens_per_s

    async def _refresh_loop(self) -> None:
        interval = self.config.router.stats_interval_s
        last_log = time.monotonic()
        while True:
            await asyncio.sleep(_REFRESH_S)
            try:
                await self.refresh_stats()
            except Exception:  # task boundary: keep the loop alive
                logger.error("stats refresh failed", exc_info=True)
                continue
            since = time.monotonic() - last_log
            busy = self.router.requests or self.output_tokens_per_s > 0
            if interval and since >= interval and (busy or since >= _IDLE_LOG_S):
                last_log = time.monotonic()
                logger.info("%s", self.stats_line())

    def stats_line(self) -> str:
        decodes = [w for w in self.router.pool(DECODE) if w.stats is not None]
        prefills = [w for w in self.router.pool(PREFILL) if w.stats is not None]
        used = sum(w.stats.pages_used for w in decodes)
        total = sum(w.num_pages for w in decodes) or 1
        line = (
            f"requests {len(self.router.requests)} | decode running "
            f"{sum(w.stats.num_running for w in decodes)} waiting {sum(w.stats.num_waiting for w in decodes)}"
            f" | {self.output_tokens_per_s:.1f} tok/s | decode KV {100 * used / total:.1f}%"
        )
        if prefills:
            line += (
                f" | prefill queued {sum(w.stats.num_queued for w in prefills)} "
                f"({sum(w.stats.queued_tokens for w in prefills)} tokens)"
            )
        return line

    async def stop(self) -> None:
        """Health NOT_SERVING, requests in flight get shutdown_grace_s to finish, those still open then end
        with a last chunk whose finish_reason is abort, then the workers stop."""
        self.serving = False
        grace = self.config.router.shutdown_grace_s
        if hasattr(self, "health"):
            await self.health.enter_graceful_shutdown()
        if hasattr(self, "supervisor"):
            await self.supervisor.stop()
        if hasattr(self, "router"):
            await self.router.wait_idle(grace)
            await self.router.close_all()
        if hasattr(self, "grpc_server"):
            await self.grpc_server.stop(grace)
        if hasattr(self, "http"):
            await self.http.stop()
        if hasattr(self, "metrics_http"):
            await self.metrics_http.stop()
        for task in self._tasks:
            task.cancel()
        if hasattr(self, "router"):
            await self.scaler.stop_all()
        logger.info("stopped")


class ServerThread:
    """A PdServer on its own event loop in a background thread (tests, `pdserve demo`); Ray must be connected."""

    def __init__(self, config: ServeConfig):
        self.server = PdServer(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pdserve", daemon=True)

    def start(self, timeout_s: float = 600.0) -> ServerThread:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self.server.start(), self._loop)
        try:
            future.result(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def http_url(self) -> str:
        return self.server.http_url

    def call(self, coro, timeout_s: float = 60.0):
        """Runs a coroutine on the server's loop (tests reach into the router through this)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self.call(self.server.stop(), timeout_s=120)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
