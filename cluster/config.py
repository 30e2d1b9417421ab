"""Serve configuration: one frozen dataclass per component, composed into `ServeConfig`, loaded from defaults, a
YAML file and command-line flags (in that order of precedence, last wins). Each component receives only its own
piece; values found at run time (KV pages, the store's address) live in runtime objects, never in these."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from pdserve.cluster.config_keys import (
    check_type,
    key_value,
    replace_section,
    section_keys,
)
from pdserve.cluster.placement import RANK_SPANS
from pdserve.cluster.prefix_routing import HOST_HIT_WEIGHT
from pdserve.decode import DecodeConfig
from pdserve.kvtransfer import KVTransferConfig
from pdserve.model.errors import ConfigError
from pdserve.prefill import PrefillConfig

DTYPES = ("auto", "bf16", "fp16", "fp32")
KERNELS = ("auto", "ref", "triton")
KV_CACHE_DTYPES = ("auto", "fp8")
"""As pdserve.model.kv_cache's (not imported: it would import torch into the command line)."""
LOAD_FORMATS = ("safetensors", "dummy")
"""As pdserve.model.loader's (not imported, for the same reason)."""
REASONING_PARSERS = ("auto", "deepseek_r1", "none")
CPU_CACHE_BYTES = 256 << 20
"""KV cache per worker on a CPU when serving (the workers' own default, 1 GiB, is more than a laptop wants)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str = "tiny"
    """Checkpoint directory in the official DeepSeek-V3 layout, or `tiny`: a small random model made once under
    ~/.cache/pdserve."""
    dtype: str = "auto"
    """Activation dtype: auto (config.json's torch_dtype), bf16, fp16 or fp32."""
    kernels: str = "auto"
    """Kernel implementation: auto (Triton on GPUs, torch references on CPU), ref or triton."""
    batch_invariant: bool = False
    """Batch-invariant kernels: a request's tokens do not depend on the requests batched with it
    (greedy outputs equal `pdserve offline --batch-invariant`'s), at some cost in speed."""
    kv_cache_dtype: str = "auto"
    """KV cache rows: auto (the activation dtype) or fp8 (the latent in e4m3 with a per-token scale,
    rope in bf16: 1.76x the tokens per GiB for DeepSeek-V3, attention on a small loss of accuracy)."""
    load_format: str = "safetensors"
    """safetensors (the checkpoint's weights; each rank reads only its share) or dummy: random weights of
    config.json's shapes made on each GPU, no weight read from disk (a full-size model without its 700 GB
    checkpoint: `pdserve make-checkpoint DIR --preset v3-shape --config-only`). Outputs are meaningless, speed
    and memory are the real model's."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels={self.kernels!r}: expected one of {', '.join(KERNELS)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format={self.load_format!r}: expected one of {', '.join(LOAD_FORMATS)}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r}: expected one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterConfig:
    num_prefill: int = 1
    """Prefill workers; 0 makes the decode workers prefill prompts themselves (aggregated serving)."""
    num_decode: int = 1
    """Decode workers (at least 1)."""
    gpus_per_worker: int | None = None
    """GPUs per worker, all on one node; the worker runs on the first. None: 1 when the Ray cluster has GPUs,
    else 0 (the worker runs on the CPU)."""
    cpus_per_worker: float = 1.0
    """Ray CPUs reserved per worker (fractions allowed); on CPU workers, also torch's thread count (at least 1)."""
    ray_address: str | None = None
    """Ray cluster to join: `auto` (the one `ray start` or `ray up` started), an address, `local` (always a new
    local Ray), or None: RAY_ADDRESS if set, else a new local Ray."""
    placement_timeout_s: float = 300.0
    """Longest a new worker may wait for free resources (its placement group) before it counts as failed."""
    rank_span: str = "node"
    """Where the ranks of a worker of several ranks may go: 'node' (all on one node) or 'nvlink_domain' (over
    the nodes of one NVLink domain, as the trays of a GB200 NVL72 rack: each node labelled
    `pdserve.nvlink_domain=<domain>` by `ray start --labels`)."""
    load_timeout_s: float = 1800.0
    """Longest a placed worker may take to load the model and warm up."""
    actor_max_concurrency: int = 16
    """Threads per worker actor for control calls (submit, abort, stats, the output long-poll)."""
    benchmark_fake_decode_ms: float = 0.0
    """BENCHMARK ONLY, never for serving: > 0 replaces each decode worker by one that loads no model and emits
    symbols, not the model's tokens: every this many ms (a grid on the node's monotonic clock) each running
    request gets benchmark_fake_decode_tokens tokens, all one symbol that names the tick (so a client can tell
    each chunk's emission time). Measures the front ends (benchmarks/frontend.py); needs num_prefill 0."""
    benchmark_fake_decode_tokens: int = 1
    """BENCHMARK ONLY: tokens per request per tick of benchmark_fake_decode_ms."""

    def __post_init__(self) -> None:
        if self.num_prefill < 0:
            raise ValueError(f"num_prefill={self.num_prefill}: must be >= 0")
        if self.num_decode < 1:
            raise ValueError(f"num_decode={self.num_decode}: must be >= 1")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"gpus_per_worker={self.gpus_per_worker}: must be >= 0")
        if self.cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker={self.cpus_per_worker}: must be positive")
        if self.rank_span not in RANK_SPANS:
            raise ValueError(
                f"rank_span={self.rank_span!r}: expected one of {', '.join(RANK_SPANS)}"
            )
        if min(self.placement_timeout_s, self.load_timeout_s) <= 0:
            raise ValueError("placement_timeout_s and load_timeout_s must be positive")
        if self.actor_max_concurrency < 4:
            raise ValueError(f"actor_max_concurrency={self.actor_max_concurrency}: must be >= 4")
        if self.benchmark_fake_decode_ms < 0 or self.benchmark_fake_decode_tokens < 1:
            raise ValueError(
                f"benchmark_fake_decode_ms={self.benchmark_fake_decode_ms} must be >= 0 (0: off) and "
                f"benchmark_fake_decode_tokens={self.benchmark_fake_decode_tokens} >= 1"
            )
        if self.benchmark_fake_decode_ms > 0 and self.num_prefill > 0:
            raise ValueError(
                f"benchmark_fake_decode_ms={self.benchmark_fake_decode_ms} (benchmark only: decode workers "
                f"without a model) needs num_prefill=0, not {self.num_prefill}"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    """Address the gRPC server listens on (0.0.0.0: every interface); beyond loopback it needs an API key
    (or security.insecure)."""
    port: int = 50051
    """gRPC port; 0 picks a free one."""
    http_port: int | None = 8000
    """OpenAI-compatible HTTP port (on `host`, beside gRPC); 0 picks a free one; none turns HTTP off."""
    metrics_port: int | None = None
    """A port (on `host`) serving only Prometheus' /metrics, for when HTTP is off or kept apart; 0 picks a
    free one; none: no such port (the HTTP port serves /metrics too)."""
    reasoning_parser: str = "auto"
    """Where chat responses put text inside <think>...</think>: deepseek_r1 (in reasoning_content, the rest in
    content), none (all in content), or auto (where the checkpoint's template and vocabulary have a think block:
    per request, deepseek_r1 when the rendered prompt leaves a think block open, else content unless the output
    opens one)."""
    max_prompt_bytes: int = 8 << 20
    """Largest prompt text (a chat's rendered messages included) in bytes, refused before it is tokenized; an
    HTTP request body may be twice that plus 1 MiB (JSON escapes), refused before it is parsed."""
    max_message_bytes: int | None = None
    """Largest gRPC request message in bytes, refused (INVALID_ARGUMENT naming this limit) before it is
    decoded; past twice this gRPC itself refuses it unread (RESOURCE_EXHAUSTED). None: max_prompt_bytes, or
    the most text that can fit the model's context where that is less, plus 1 MiB."""
    http_header_timeout_s: float = 10.0
    """An HTTP connection must deliver a request's line and headers within this of opening, or of its previous
    response (an idle keep-alive connection is closed after it too); else 408 and the connection is closed. A
    gRPC connection must finish its handshake (TLS, HTTP/2 preface) within this, or it is closed."""
    http_body_timeout_s: float = 60.0
    """An HTTP request's body must arrive whole within this of its headers; else 408 (or, once a response
    is under way, the connection is closed)."""
    http_idle_timeout_s: float = 60.0
    """An HTTP response or gRPC stream the client stops reading (its writes blocked) for this long is cut: its
    request is cancelled, the HTTP connection closed, the gRPC call ended (DEADLINE_EXCEEDED). A gRPC
    connection with no call for this long is closed too."""
    grpc_keepalive_s: float = 30.0
    """The gRPC server pings each connection this often and closes one whose ping goes unanswered this long
    (a vanished client); clients may ping every half of it."""
    default_max_tokens: int = 256
    """max_tokens of a request that does not set it."""
    max_tokens_limit: int | None = None
    """Largest max_tokens accepted; None: the model's context length."""
    max_logprobs: int = 20
    """Most log-probability alternatives a request may ask for per token (OpenAI's top_logprobs, the
    completions API's logprobs, gRPC's sampling_params.logprobs)."""
    max_n: int = 16
    """Most choices (`n`) one request may ask for; each is a request of its own on the workers."""
    admission_timeout_s: float = 30.0
    """Longest a request waits for room on a decode worker before RESOURCE_EXHAUSTED."""
    max_queued_requests: int = 4096
    """Requests waiting for admission at most; more are refused at once with RESOURCE_EXHAUSTED."""
    drain_timeout_s: float = 600.0
    """Longest a draining worker's requests may run; those left then move to other workers (as a lost
    worker's do, within migration_limit)."""
    poll_timeout_s: float = 0.5
    """Long-poll wait of the router's output and event polls on each worker."""
    stats_interval_s: float = 5.0
    """Seconds between stats log lines (running/waiting, tokens/s, KV usage); 0 turns them off."""
    shutdown_grace_s: float = 10.0
    """On shutdown, how long requests in flight may still finish."""
    migration_limit: int = 3
    """Times one request may move to another worker after losing its own (its prompt and the tokens already
    sent are recomputed there and the stream goes on unchanged); past it the request fails with UNAVAILABLE
    naming the worker. 0: requests of a lost worker fail."""
    max_restarts: int = 3
    """Lost workers replaced per role within restart_window_s; past it (a crash loop) lost workers of that
    role are not replaced and `pdserve status` says why. 0: never replace."""
    restart_window_s: float = 600.0
    """The window of max_restarts, in seconds."""
    prefix_aware_routing: bool = True
    """Choose the worker that computes a prompt (a prefill worker; with none, the decode worker that prefills
    it) by the prompt tokens its prefix cache is expected to hold, from the workers' cache events, against its
    load, and the decode worker that receives a prompt's KV by the pages of it that it is expected to hold
    already (decode.reuse_held_prefix), against its free pages (`pdserve.cluster.prefix_routing`); off: by load
    alone."""
    prefix_load_weight: float = 1.0
    """Of those choices: a queued prompt token's weight against a token expected cached (1: the fewest tokens
    computed before the request's first token; more: balance first; less: reuse first), and a decode worker's
    free page's against a page expected held (1: the most room after the request)."""
    prefix_host_hit_weight: float = HOST_HIT_WEIGHT
    """Of the choice of the worker that computes a prompt: a prompt token expected in a worker's host KV tier
    (restored to its GPU, not computed) against one expected in its GPU prefix cache (1); in [0, 1]. Less than
    1: the restore costs host-to-device bandwidth and fresh GPU pages (`prefix_routing.HOST_HIT_WEIGHT`)."""
    heartbeat_timeout_s: float = 3.0
    """A worker silent (no answer to its stats call, sent every second, or its long-poll) this long past the
    deadline of the step it runs, or reporting a step that runs this long past it, is declared lost, killed and
    replaced. A step's deadline scales with the step: 4x what the worker's measured speed makes it take."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port}: not a port number")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port={self.http_port}: not a port number (none: no HTTP)")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port={self.metrics_port}: not a port number (none: off)")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser={self.reasoning_parser!r}: expected one of "
                f"{', '.join(REASONING_PARSERS)}"
            )
        if self.max_prompt_bytes < 1:
            raise ValueError(f"max_prompt_bytes={self.max_prompt_bytes}: must be >= 1")
        if self.max_message_bytes is not None and not 1 <= self.max_message_bytes < 1 << 30:
            raise ValueError(f"max_message_bytes={self.max_message_bytes}: must be in [1, 2**30)")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens={self.default_max_tokens}: must be >= 1")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit={self.max_tokens_limit}: must be >= 1")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs}: must be >= 0")
        if self.max_n < 1:
            raise ValueError(f"max_n={self.max_n}: must be >= 1")
        if self.migration_limit < 0 or self.max_restarts < 0:
            raise ValueError(
                f"migration_limit={self.migration_limit}, max_restarts={self.max_restarts}: "
                "must be >= 0"
            )
        names = (
            "admission_timeout_s", "drain_timeout_s", "poll_timeout_s", "restart_window_s",
            "heartbeat_timeout_s", "http_header_timeout_s", "http_body_timeout_s", "http_idle_timeout_s",
            "grpc_keepalive_s",
        )  # fmt: skip
        for name in names:
            if not getattr(self, name) > 0:  # NaN too
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")
        if not self.prefix_load_weight >= 0:
            raise ValueError(f"prefix_load_weight={self.prefix_load_weight}: must be >= 0")
        if not 0 <= self.prefix_host_hit_weight <= 1:
            raise ValueError(
                f"prefix_host_hit_weight={self.prefix_host_hit_weight}: must be in [0, 1] (a host hit "
                "counts for at most a GPU hit)"
            )
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests={self.max_queued_requests}: must be >= 1")
        if self.stats_interval_s < 0 or self.shutdown_grace_s < 0:
            raise ValueError("stats_interval_s and shutdown_grace_s must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class SecurityConfig:
    """Keys and TLS of the front ends. The keys themselves are read at start-up (`security.Credentials`):
    a key given here, else its file, else its environment variable."""

    api_key: str | None = dataclasses.field(default=None, repr=False)
    """Key every HTTP endpoint but /health and every gRPC method but grpc.health.v1 require, sent as
    `authorization: Bearer KEY` (as OpenAI clients send it). Unset: api_key_file, else env PDSERVE_API_KEY,
    else none (open). A key on the command line shows in `ps`: prefer the file or the environment."""
    api_key_file: str | None = None
    """File holding the API key (its first line; ~ expands)."""
    admin_key: str | None = dataclasses.field(default=None, repr=False)
    """Key the Admin service (status, scale, drain) requires; the API key cannot call it. Unset:
    admin_key_file, else env PDSERVE_ADMIN_KEY, else none: Admin is open when no API key is set either,
    and refused (PERMISSION_DENIED) when one is."""
    admin_key_file: str | None = None
    """File holding the admin key (its first line; ~ expands)."""
    tls_cert: str | None = None
    """PEM certificate (chain) of the gRPC and HTTP ports; with tls_key, both serve TLS only."""
    tls_key: str | None = None
    """PEM private key of tls_cert."""
    tls_client_ca: str | None = None
    """PEM CA bundle: gRPC and HTTP clients must present a certificate it signed (mutual TLS)."""
    insecure: bool = False
    """Serve open (no API key, no client certificates) on a --host beyond loopback: refused without this;
    with it, a WARNING at start-up names each open endpoint."""

    def __post_init__(self) -> None:
        for name in ("api_key", "admin_key"):
            if getattr(self, name) is not None and getattr(self, f"{name}_file") is not None:
                raise ValueError(f"{name} and {name}_file: give one, not both")
            if getattr(self, name) == "":
                raise ValueError(f"{name}: empty (leave it unset for none)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (mutual TLS is over TLS)")


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    num_tokens: int | None = None
    """Speculative decoding with the checkpoint's MTP module: draft tokens a step (0: off, at most 4), for
    both pools (sets decode.num_speculative_tokens and prefill.num_speculative_tokens unless a pool's own
    key is given)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything `pdserve serve` needs; YAML sections and flag prefixes are the field names."""

    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    router: RouterConfig = RouterConfig()
    prefill: PrefillConfig = PrefillConfig(cpu_cache_bytes=CPU_CACHE_BYTES)
    decode: DecodeConfig = DecodeConfig(cpu_cache_bytes=CPU_CACHE_BYTES)
    kvtransfer: KVTransferConfig = KVTransferConfig()
    security: SecurityConfig = SecurityConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    def __post_init__(self) -> None:
        if self.prefill.page_size != self.decode.page_size:
            raise ValueError(
                f"prefill.page_size={self.prefill.page_size} and decode.page_size="
                f"{self.decode.page_size} must be equal"
            )
        decode, prefill = self.decode.layout, self.prefill.layout
        if decode.ranks > 1 and decode.attention != "data" and self.cluster.num_prefill > 0:
            raise ValueError(
                f"decode.attention={decode.attention!r} with decode.ranks={decode.ranks} needs "
                "cluster.num_prefill=0: each rank of a decode worker receives the KV pages of its own "
                "requests (attention='data'); a tensor-parallel one serves aggregated requests only"
            )
        if prefill.ranks > 1 and prefill.attention != "tensor":
            raise ValueError(
                f"prefill.attention={prefill.attention!r} with prefill.ranks={prefill.ranks}: a "
                "prefill worker sends its KV from rank 0, so several ranks need attention='tensor'"
            )
        drafts = self.decode.num_speculative_tokens
        if drafts and self.cluster.num_prefill > 0 and not self.prefill.num_speculative_tokens:
            raise ValueError(
                f"decode.num_speculative_tokens={drafts} needs prefill.num_speculative_tokens > 0 "
                "(the prefill workers then fill the MTP module's cache; speculative.num_tokens sets both)"
            )
        if self.kvtransfer.idle_timeout_s <= self.decode.kv_wait_timeout_s:
            raise ValueError(
                f"kvtransfer.idle_timeout_s={self.kvtransfer.idle_timeout_s} must exceed "
                f"decode.kv_wait_timeout_s={self.decode.kv_wait_timeout_s}"
            )


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cluster": ClusterConfig,
    "router": RouterConfig,
    "prefill": PrefillConfig,
    "decode": DecodeConfig,
    "kvtransfer": KVTransferConfig,
    "security": SecurityConfig,
    "speculative": SpeculativeConfig,
}
SECRET_FIELDS = (("security", "api_key"), ("security", "admin_key"))
"""Fields never printed (`to_dict` shows a set one as <set>)."""


def build_config(
    file_values: dict[str, dict[str, Any]] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> ServeConfig:
    """A ServeConfig from defaults, then `file_values` (a YAML mapping of sections), then `overrides` (flags).
    Unknown sections or fields and bad values raise ConfigError naming them."""
    merged: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for source, values in (("config file", file_values or {}), ("flags", overrides or {})):
        if not isinstance(values, dict):
            raise ConfigError(
                f"{source}: expected a mapping of sections, got {type(values).__name__}"
            )
        for section, fields in values.items():
            if section not in SECTIONS:
                raise ConfigError(
                    f"{source}: unknown section {section!r} (expected {', '.join(SECTIONS)})"
                )
            if not isinstance(fields, dict):
                raise ConfigError(f"{source}: section {section!r} must be a mapping")
            keys = section_keys(SECTIONS[section])
            for name, value in fields.items():
                if name not in keys:
                    raise ConfigError(
                        f"{source}: unknown field {section}.{name} "
                        f"(expected one of {', '.join(keys)})"
                    )
                merged[section][name] = check_type(
                    value, keys[name].annotation, f"{section}.{name}"
                )
    drafts = merged["speculative"].get("num_tokens")
    if drafts is not None:  # the shorthand for both pools, unless a pool gives its own
        for pool in ("decode", "prefill"):
            merged[pool].setdefault("num_speculative_tokens", drafts)
    defaults, parts = ServeConfig(), {}
    for name in SECTIONS:
        try:
            parts[name] = replace_section(getattr(defaults, name), merged[name])
        except ValueError as e:
            raise ConfigError(f"{name}.{e}") from e
    try:
        return ServeConfig(**parts)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def load_yaml(path: str | Path) -> dict[str, dict[str, Any]]:
    path = Path(path)
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from e
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of sections")
    return values


def to_dict(config: ServeConfig) -> dict[str, dict[str, Any]]:
    """The config as YAML-ready sections (for `pdserve serve --print-config`); keys show as <set>."""
    sections = {
        name: {key: key_value(getattr(config, name), key) for key in section_keys(cls)}
        for name, cls in SECTIONS.items()
    }
    for section, name in SECRET_FIELDS:
        if sections[section][name] is not None:
            sections[section][name] = "<set>"
    return sections
