"""The serving subcommands of `pdserve`: serve, generate, status, scale, drain, demo. `serve` gets one flag per
config field (`--decode.max-running 128`; help from the field's docstring) besides its short flags; precedence:
defaults < --config FILE.yaml < flags."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from typing import TYPE_CHECKING

import yaml

from pdserve.model.errors import PdserveError

if TYPE_CHECKING:
    from pdserve.cluster.config import ServeConfig


DEFAULT_ADDR = "127.0.0.1:50051"
_SHORT_FLAGS = {
    # flag: (section, field, type, metavar, help)
    "--model": (
        "model",
        "path",
        str,
        "DIR|tiny",
        "checkpoint directory, or `tiny` (made once, cached)",
    ),
    "--dtype": ("model", "dtype", str, "DTYPE", "activation dtype: auto, bf16, fp16, fp32"),
    "--kernels": ("model", "kernels", str, "KIND", "auto, ref (torch references) or triton"),
    "--prefill": ("cluster", "num_prefill", int, "N", "prefill workers; 0: decode workers prefill"),
    "--decode": ("cluster", "num_decode", int, "M", "decode workers"),
    "--gpus-per-worker": (
        "cluster",
        "gpus_per_worker",
        int,
        "K",
        "GPUs per worker (default: 1 if any)",
    ),
    "--ray-address": ("cluster", "ray_address", str, "auto|ADDR", "join this Ray cluster"),
    "--host": (
        "router", "host", str, "HOST",
        "listen address (default 127.0.0.1; 0.0.0.0: all, which needs an API key or --insecure)",
    ),
    "--port": ("router", "port", int, "PORT", "gRPC port (default 50051; 0: any free port)"),
    "--http-port": (
        "router",
        "http_port",
        int,
        "PORT",
        "OpenAI-compatible HTTP port (default 8000; 0: any free port; --router.http-port none: off)",
    ),
    "--api-key": (
        "security", "api_key", str, "KEY",
        "key every endpoint but health requires (or --security.api-key-file, or env PDSERVE_API_KEY)",
    ),
    "--admin-key": (
        "security", "admin_key", str, "KEY",
        "key of the Admin service: status, scale, drain (or --security.admin-key-file, or env "
        "PDSERVE_ADMIN_KEY)",
    ),
    "--tls-cert": ("security", "tls_cert", str, "PEM", "serve gRPC and HTTP over TLS with this certificate"),
    "--tls-key": ("security", "tls_key", str, "PEM", "private key of --tls-cert"),
    "--tls-client-ca": (
        "security", "tls_client_ca", str, "PEM", "require client certificates this CA signed (mTLS)",
    ),
    "--insecure": (
        "security", "insecure", bool, None,
        "serve with no API key on a --host beyond loopback (refused without it; a WARNING names what is "
        "open)",
    ),
}  # fmt: skip
SERVE_USAGE = (
    "pdserve serve [--model DIR|tiny] [--prefill N] [--decode M] [--gpus-per-worker K] [--host HOST]\n"
    "                     [--port PORT] [--http-port PORT] [--config FILE.yaml] [--ray-address auto|ADDR]\n"
    "                     [--api-key KEY] [--admin-key KEY] [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]]\n"
    "                     [--insecure]\n"
    "                     [--SECTION.FIELD VALUE ...] [--print-config]"
)
SAMPLING_DEFAULT = (
    "Greedy (temperature 0) unless --temperature is given; --model-sampling takes the temperature of the "
    "model's generation_config.json instead, as the gRPC API does for a request that leaves it unset. Other "
    "sampling flags left unset take generation_config.json's values."
)
"""The sampling default that `pdserve generate` and `pdserve offline` share, so that one prompt gives one output."""
logger = logging.getLogger("pdserve")


def add_temperature_flags(group) -> None:
    """--temperature and --model-sampling (exclusive) on an argparse group: see SAMPLING_DEFAULT."""
    choice = group.add_mutually_exclusive_group()
    choice.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature; 0: greedy (default)"
    )
    choice.add_argument(
        "--model-sampling", action="store_true",
        help="sample with the temperature of the model's generation_config.json (greedy by default)",
    )  # fmt: skip


def temperature_of(args: argparse.Namespace) -> float | None:
    """The temperature the flags ask for; None: the model's (generation_config.json)."""
    if args.temperature is not None:
        return args.temperature
    return None if args.model_sampling else 0.0


def _flag_dest(section: str, name: str) -> str:
    return f"cfg__{section}__{name}"


def add_config_flags(p: argparse.ArgumentParser) -> None:
    from pdserve.cluster.config import SECTIONS, ServeConfig, key_value, section_keys

    p.add_argument("--config", metavar="FILE.yaml", help="serve config (sections as below)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config, exit")
    short = p.add_argument_group("common")
    for flag, (section, name, kind, metavar, text) in _SHORT_FLAGS.items():
        if kind is bool:  # a switch: given, it sets the field true
            short.add_argument(
                flag, dest=_flag_dest(section, name), action="store_const", const=True,
                default=argparse.SUPPRESS, help=text,
            )  # fmt: skip
            continue
        short.add_argument(
            flag, dest=_flag_dest(section, name), type=kind, metavar=metavar,
            default=argparse.SUPPRESS, help=text,
        )  # fmt: skip
    defaults = ServeConfig()
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(f"{section} (config section `{section}:`)")
        for name, key in section_keys(cls).items():
            default = key_value(getattr(defaults, section), name)
            group.add_argument(
                f"--{section}.{name.replace('_', '-')}",
                dest=f"raw__{section}__{name}",
                metavar=key.annotation.replace(" ", ""),
                default=argparse.SUPPRESS,
                help=f"{key.doc} (default: {default})".replace("%", "%%"),
            )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    from pdserve.cluster.config import SECTIONS, build_config, load_yaml, parse_value, section_keys

    overrides: dict[str, dict] = {}
    for key, value in vars(args).items():
        kind, _, rest = key.partition("__")
        if kind not in ("cfg", "raw"):
            continue
        section, name = rest.split("__")
        if kind == "raw":
            annotation = section_keys(SECTIONS[section])[name].annotation
            value = parse_value(value, annotation, f"--{section}.{name.replace('_', '-')}")
        overrides.setdefault(section, {})[name] = value
    file_values = load_yaml(args.config) if args.config else None
    return build_config(file_values, overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.cluster.config import to_dict

    config = config_from_args(args)
    if args.print_config:
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        return 0
    from pdserve.cluster.ray_connect import connect_ray
    from pdserve.frontend.server import PdServer

    server = PdServer(config)
    server.prepare()  # a bad --model or a busy port fails here, before Ray's seconds of start-up
    connect_ray(config)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await server.start()
            logger.info('ready: `pdserve generate --addr %s "Hello"`; Ctrl-C stops', server.address)
            if server.http_url:
                logger.info(
                    "OpenAI-compatible API at %s (model %r)", server.http_url, server.model.name
                )
            await stop.wait()
            logger.info(
                "shutting down (requests in flight get %gs)", config.router.shutdown_grace_s
            )
        finally:
            await server.stop()

    asyncio.run(serve())
    return 0


def _add_addr(p: argparse.ArgumentParser) -> None:
    """--addr, and the key and TLS flags of a client command (keys default to the environment's)."""
    p.add_argument("--addr", default=DEFAULT_ADDR, help=f"server address (default {DEFAULT_ADDR})")
    g = p.add_argument_group("keys and TLS")
    g.add_argument(
        "--api-key", default=None,
        help="the server's API key (default: env PDSERVE_API_KEY); status, scale and drain send the admin "
        "key instead when one is given",
    )  # fmt: skip
    g.add_argument(
        "--admin-key", default=None, help="the server's admin key (default: env PDSERVE_ADMIN_KEY)"
    )
    g.add_argument(
        "--tls-ca", default=None, metavar="PEM",
        help="connect over TLS, trusting this CA ('' : the system's roots)",
    )  # fmt: skip
    g.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="client certificate (mutual TLS)"
    )
    g.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")


def _client(args: argparse.Namespace, admin: bool = False):
    """A Client for the command's flags: the admin key (flag, else env) for admin calls when there is one,
    else the API key (flag, else env)."""
    import os

    from pdserve.cli.client import Client
    from pdserve.frontend.security import ADMIN_KEY_ENV, API_KEY_ENV

    key = args.api_key or os.environ.get(API_KEY_ENV)
    if admin:
        key = args.admin_key or os.environ.get(ADMIN_KEY_ENV) or key
    return Client(
        args.addr, key=key, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.cli.client import FINISH_REASONS, generate_request

    if args.prompt_ids is not None:
        prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        raise PdserveError("give a PROMPT or --prompt-ids")
    request = generate_request(
        prompt, max_tokens=args.max_tokens, temperature=temperature_of(args), top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
        stop_token_ids=[int(x) for x in args.stop_token_ids.split(",") if x.strip()],
        stop=args.stop,
    )  # fmt: skip
    with _client(args) as client:
        if args.wait_s:
            client.wait_until_serving(args.wait_s)
        sent, first, token_ids, pieces, last = time.perf_counter(), None, [], [], None
        for chunk in client.generate(request, timeout_s=args.timeout):
            if first is None and chunk.token_ids:
                first = time.perf_counter()
            token_ids.extend(chunk.token_ids)
            pieces.append(chunk.text)
            if not args.json:
                print(chunk.text, end="", flush=True)
            last = chunk
    if args.json:
        reason = FINISH_REASONS[last.finish_reason]
        print(
            json.dumps({"token_ids": token_ids, "text": "".join(pieces), "finish_reason": reason})
        )
        return 0
    elapsed = time.perf_counter() - (first or sent)
    n = last.usage.completion_tokens
    print(
        f"\n[{last.usage.prompt_tokens} prompt tokens, {n} generated, finish_reason="
        f"{FINISH_REASONS.get(last.finish_reason, '?')}, TTFT {1e3 * ((first or sent) - sent):.0f} ms, "
        f"{(n - 1) / elapsed if n > 1 and elapsed > 0 else 0:.1f} tokens/s]",
        file=sys.stderr,
    )
    t = last.timings
    print(
        f"[stages: router queue {1e3 * t.queued_s:.1f} ms, prefill queue {1e3 * t.prefill_queue_s:.1f} ms, "
        f"prefill {1e3 * t.prefill_s:.1f} ms, KV transfer {1e3 * t.kv_transfer_s:.1f} ms, decode queue "
        f"{1e3 * t.decode_queue_s:.1f} ms, first token {1e3 * t.time_to_first_token_s:.1f} ms; "
        f"{t.prefill_worker or 'prefilled by the decode worker'} -> {t.decode_worker}]",
        file=sys.stderr,
    )
    if last.usage.HasField("speculative"):
        spec = last.usage.speculative
        print(
            f"[speculation: {spec.accepted_tokens}/{spec.draft_tokens} drafts accepted, "
            f"{spec.mean_accepted_length:.2f} tokens a verifying step]",
            file=sys.stderr,
        )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from pdserve.cli.client import format_status

    with _client(args, admin=True) as client:
        status = client.status()
    print(json_format.MessageToJson(status) if args.json else format_status(status))
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    if args.prefill is None and args.decode is None:
        raise PdserveError("give --prefill N and/or --decode M")
    with _client(args, admin=True) as client:
        for role in ("prefill", "decode"):
            count = getattr(args, role)
            if count is not None:
                reply = client.scale(role, count)
                print(f"{role}: {len(reply.pool.workers)} workers; added {list(reply.added)}, "
                      f"removed {list(reply.removed)}")  # fmt: skip
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    with _client(args, admin=True) as client:
        reply = client.drain(args.worker_id)
    print(f"drained and stopped {reply.worker_id} ({reply.num_requests_drained} requests finished)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pdserve.cli.demo import run_demo
    from pdserve.cluster.config import build_config

    overrides = {
        "model": {"path": args.model, "dtype": args.dtype, "kernels": args.kernels},
        "cluster": {"ray_address": "local"},
        "router": {"port": 0, "http_port": None, "stats_interval_s": 0.0},
    }
    return run_demo(build_config(None, overrides), args.max_tokens)


def add_commands(sub, config_flags: bool = True) -> dict:
    """Adds the serving subcommands to `pdserve`'s subparsers; returns {name: handler}."""
    serve = sub.add_parser(
        "serve",
        help="serve a model over gRPC and OpenAI-compatible HTTP with Ray prefill and decode pools",
        description="Starts (or joins, --ray-address) a Ray cluster, places one actor per worker, and serves "
        "the gRPC API (pdserve.v1.Generation, pdserve.v1.Admin, grpc.health.v1, reflection) and, on "
        "--http-port, the OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions, "
        "/health, /version, /metrics: Prometheus). With no arguments: the tiny model on the CPU, one "
        "prefill and one decode worker, gRPC on 127.0.0.1:50051 and HTTP on 127.0.0.1:8000.",
        allow_abbrev=False,
        usage=SERVE_USAGE,
    )
    if config_flags:
        add_config_flags(serve)

    gen = sub.add_parser(
        "generate",
        help="stream a generation from a running server",
        description="Streams the generated text to stdout; a summary (TTFT, tokens/s, the stage times) goes to stderr. "
        + SAMPLING_DEFAULT,
    )
    _add_addr(gen)
    gen.add_argument("prompt", nargs="?", help="prompt text")
    gen.add_argument("--prompt-ids", help="comma-separated prompt token ids instead of text")
    gen.add_argument("--max-tokens", type=int, default=None, help="default: the server's (256)")
    add_temperature_flags(gen)
    gen.add_argument("--top-p", type=float, default=None, help="unset: the model's")
    gen.add_argument("--top-k", type=int, default=None, help="unset: the model's")
    gen.add_argument("--min-p", type=float, default=None, help="unset: the model's")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop-token-ids", default="", help="comma-separated ids")
    gen.add_argument(
        "--stop", action="append", default=[], metavar="TEXT",
        help="stop string: the text ends just before it (repeatable)",
    )  # fmt: skip
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--wait-s", type=float, default=0, help="first wait this long for SERVING")
    gen.add_argument("--json", action="store_true", help="print token ids as JSON at the end")

    status = sub.add_parser("status", help="pools, workers, queues and KV pages in use")
    _add_addr(status)
    status.add_argument("--json", action="store_true")

    scale = sub.add_parser(
        "scale",
        help="grow or shrink the prefill and decode pools",
        description="Returns when new workers serve and removed ones are drained (their requests done).",
    )
    _add_addr(scale)
    scale.add_argument("--prefill", type=int, help="prefill workers wanted (0: aggregated)")
    scale.add_argument("--decode", type=int, help="decode workers wanted (>= 1)")

    drain = sub.add_parser("drain", help="stop one worker after its requests finish")
    _add_addr(drain)
    drain.add_argument("worker_id", help="as `pdserve status` lists it, e.g. decode-1")

    demo = sub.add_parser(
        "demo",
        help="start the embedded default, stream a few generations, shut down",
        description="Starts a local Ray and the server on free ports (tiny model, 1 prefill + 1 decode "
        "worker), streams three generations with their TTFT and tokens/s, and stops.",
    )
    demo.add_argument("--model", default="tiny", help="checkpoint directory or tiny")
    demo.add_argument("--dtype", default="auto", help="auto, bf16, fp16 or fp32")
    demo.add_argument("--kernels", default="auto", help="auto, ref or triton")
    demo.add_argument("--max-tokens", type=int, default=32)
    return {
        "serve": cmd_serve, "generate": cmd_generate, "status": cmd_status, "scale": cmd_scale,
        "drain": cmd_drain, "demo": cmd_demo,
    }  # fmt: skip
