"""Who may call the front ends, and over what: the API and admin keys (`Credentials`), their check on every gRPC
method (`KeyInterceptor`) and HTTP request (`require_key`), the TLS material of both ports, and the refusal to
listen beyond loopback with no key (`check_exposure`) unless --insecure says so.

Open on purpose, keys or not: gRPC's grpc.health.v1 and HTTP's /health, which load balancers and orchestrators
probe without credentials (as vLLM leaves /health open); they tell only whether the server is serving. Everything
else needs `authorization: Bearer KEY`: the API key (or the admin key) for generation, /v1/*, /metrics,
/version and reflection; the admin key alone for pdserve.v1.Admin (status, scale, drain). Keys are compared in
constant time (over their SHA-256 digests, so that neither content nor length leaks through timing)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path

import grpc

from pdserve.cluster.config import SecurityConfig
from pdserve.cluster.errors import PermissionDeniedError, UnauthenticatedError
from pdserve.cluster.ray_connect import is_loopback
from pdserve.frontend.errors import status_for
from pdserve.model.errors import ConfigError, PdserveError

logger = logging.getLogger(__name__)

API_KEY_ENV = "PDSERVE_API_KEY"
ADMIN_KEY_ENV = "PDSERVE_ADMIN_KEY"
OPEN_GRPC_SERVICES = ("/grpc.health.v1.Health/",)
OPEN_HTTP_PATHS = ("/health",)
ADMIN_GRPC_SERVICE = "/pdserve.v1.Admin/"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _read_key(path: str, flag: str) -> str:
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read ({e.strerror})") from e
    key = lines[0].strip() if lines else ""
    if not key:
        raise ConfigError(f"{flag} {path}: the file's first line is empty")
    return key


def _resolve(value: str | None, path: str | None, env: str, name: str) -> str | None:
    if value is not None:
        return value
    if path is not None:
        return _read_key(path, f"--security.{name}-file")
    return os.environ.get(env) or None


@dataclasses.dataclass(frozen=True, slots=True)
class Credentials:
    """The digests of the keys a server accepts (None: that key is not set). Holds no key text."""

    api: bytes | None = dataclasses.field(default=None, repr=False)
    admin: bytes | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def resolve(cls, config: SecurityConfig) -> Credentials:
        """From the config's key, else its file, else the environment (PDSERVE_API_KEY, PDSERVE_ADMIN_KEY)."""
        api = _resolve(config.api_key, config.api_key_file, API_KEY_ENV, "api-key")
        admin = _resolve(config.admin_key, config.admin_key_file, ADMIN_KEY_ENV, "admin-key")
        if api is not None and admin is not None and hmac.compare_digest(api, admin):
            raise ConfigError("the API key and the admin key are equal: the admin key must differ")
        return cls(
            api=None if api is None else _digest(api),
            admin=None if admin is None else _digest(admin),
        )

    @property
    def open(self) -> bool:
        return self.api is None and self.admin is None

    def _matches(self, key: str, digest: bytes | None) -> bool:
        return digest is not None and hmac.compare_digest(_digest(key), digest)

    def check(self, authorization: str | None, admin: bool) -> None:
        """Raises UnauthenticatedError or PermissionDeniedError unless `authorization` (the header's value,
        `Bearer KEY`) may make a call of this kind. A non-admin call needs the API key or the admin key (none
        when neither is set); an admin call needs the admin key (none when no key at all is set)."""
        if self.open or (not admin and self.api is None):
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise UnauthenticatedError(
                "no API key: send the header `authorization: Bearer KEY` (OpenAI clients: api_key=KEY)"
            )
        key = key.strip()
        if self._matches(key, self.admin):
            return
        if self._matches(key, self.api):
            if not admin:
                return
            if self.admin is None:
                raise PermissionDeniedError(
                    "admin calls (status, scale, drain) need the admin key, and this server has none "
                    "(start it with --admin-key, --security.admin-key-file or PDSERVE_ADMIN_KEY)"
                )
            raise PermissionDeniedError(
                "the API key cannot make admin calls (status, scale, drain): use the admin key"
            )
        raise UnauthenticatedError("invalid API key")

    @property
    def generation_auth(self) -> str:
        """What a generation call needs, in words (`pdserve status`)."""
        if self.api is not None:
            return "API key"
        return "none" if self.admin is None else "none (the admin key only for Admin)"

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.open:
            return "no API key: every endpoint is open (set --api-key or PDSERVE_API_KEY)"
        api = "API key required" if self.api is not None else "generation open (no API key)"
        admin = (
            "admin key required for Admin"
            if self.admin is not None
            else "Admin refused (no admin key)"
        )
        return f"{api}; {admin}; health open"


# Exposure.


def check_exposure(host: str, credentials: Credentials, config: SecurityConfig) -> None:
    """Refuses (ConfigError) to listen on a non-loopback `host` with no API key and no client certificates
    required (tls_client_ca), unless config.insecure: then the caller warns (`open_doors_warning`)."""
    if is_loopback(host) or credentials.api is not None or config.tls_client_ca is not None:
        return
    if config.insecure:
        return
    raise ConfigError(
        f"--host {host}: listening beyond loopback with no API key would let anyone who reaches this "
        "address generate (and, with no admin key, scale and drain): set --api-key, "
        "--security.api-key-file or PDSERVE_API_KEY (or require client certificates: --tls-client-ca), or "
        "pass --insecure to serve open on purpose"
    )


def open_doors_warning(
    host: str, credentials: Credentials, config: SecurityConfig, endpoints: list[str]
) -> str | None:
    """The WARNING to log once listening (None: nothing open beyond loopback): `endpoints` are what listens on
    `host`, as `name host:port` lines."""
    if is_loopback(host) or credentials.api is not None or config.tls_client_ca is not None:
        return None
    return (
        f"--insecure: open to anyone who reaches {host} (no API key, no client certificate): "
        + "; ".join(endpoints)
    )


# gRPC.


def _metadata_value(metadata, name: str) -> str | None:
    for key, value in metadata or ():
        if key == name:
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def _refusing(handler: grpc.RpcMethodHandler, error: PdserveError) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by an abort with `error`'s status (same streaming kind, same
    deserializer: the request is decoded only as far as grpc must)."""
    code, message = status_for(error)

    async def refuse(request, context):
        await context.abort(code, message)

    kind = ("stream_" if handler.request_streaming else "unary_") + (
        "stream" if handler.response_streaming else "unary"
    )
    return handler._replace(**{kind: refuse})


class KeyInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call's `authorization` metadata against `Credentials` before its method runs."""

    def __init__(self, credentials: Credentials):
        self.credentials = credentials

    async def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_GRPC_SERVICES):
            return handler
        authorization = _metadata_value(handler_call_details.invocation_metadata, "authorization")
        try:
            self.credentials.check(authorization, admin=method.startswith(ADMIN_GRPC_SERVICE))
        except (UnauthenticatedError, PermissionDeniedError) as e:
            logger.debug("refused %s: %s", method, e)
            return _refusing(handler, e)
        return handler


def grpc_server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of the gRPC port (None: plaintext); with tls_client_ca, clients must present a
    certificate that CA signed."""
    if config.tls_cert is None:
        return None
    cert = _read_pem(config.tls_cert, "--tls-cert")
    key = _read_pem(config.tls_key, "--tls-key")
    ca = (
        None if config.tls_client_ca is None else _read_pem(config.tls_client_ca, "--tls-client-ca")
    )
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def _read_pem(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read ({e.strerror})") from e
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{flag} {path}: not a PEM file")
    return data


def http_ssl_options(config: SecurityConfig) -> dict:
    """uvicorn.Config's TLS arguments for the HTTP port (empty: plaintext). The files are checked here, so that
    a bad one fails as a ConfigError naming the flag."""
    if config.tls_cert is None:
        return {}
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"--tls-cert {config.tls_cert} / --tls-key {config.tls_key}: {e}") from e
    options = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
    if config.tls_client_ca is not None:
        _read_pem(config.tls_client_ca, "--tls-client-ca")
        options |= {"ssl_ca_certs": config.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


# HTTP.


def require_key(app, credentials: Credentials, error_response: Callable[[PdserveError], object]):
    """An ASGI app that answers 401/403 (`error_response(error)`, itself an ASGI app) to a request without the
    key its path needs, and passes the rest to `app`. Nothing of the request but its headers is read first."""
    if credentials.open:
        return app

    async def checked(scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_HTTP_PATHS:
            authorization = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization = value.decode("latin-1")
                    break
            try:
                credentials.check(authorization, admin=False)
            except (UnauthenticatedError, PermissionDeniedError) as e:
                response = error_response(e)
                if isinstance(e, UnauthenticatedError):
                    response.headers["www-authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await app(scope, receive, send)

    return checked
