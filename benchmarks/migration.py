"""Request migration under load: greedy streams against `pdserve serve` (in this process, on a local Ray), one
decode worker's process killed by PID mid-stream (SIGKILL, as an Xid error or an out-of-memory kill would end
it); every stream must finish with the offline path's tokens, and the time from the kill to the next token of
each stream that was on the killed worker is reported (p50/p99), with the replacement's start time.

    python benchmarks/migration.py --model /tmp/v2l --streams 64            # two GPUs, batch-invariant
    python benchmarks/migration.py --device cpu --streams 8 --output-len 24 # smoke test: tiny model, CPU

Layout: `--prefill`/`--decode` workers of one GPU each (whole GPUs: on two GPUs that is no prefill worker and
two decode workers, which then prefill themselves, and a migrated stream is recomputed by the surviving decode
worker); on the CPU 1 prefill + 2 decode workers by default. The victim is the decode worker holding the most
streams once each of its streams has `--kill-after` tokens. The offline check runs after the server has stopped
(the GPUs are free again), on the first GPU, with the same kernels and batch-invariant mode. Prints a summary
and its JSON (also written to $OUT/migration.json when OUT is set, with every stream's prompt and tokens in
$OUT/migration_streams.json); exits 1 when a stream failed or differed. The offline path runs one stream at a
time, eagerly: where a command's time is short, check some streams after serving (--check-n) and the rest in
later runs (--check-file $OUT/migration_streams.json --check-start K --check-n M).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import ray

from pdserve.cli.client import Client, generate_request
from pdserve.cluster.config import build_config
from pdserve.engine import messages
from pdserve.frontend.server import ServerThread, free_port
from pdserve.v1 import generation_pb2_grpc

_POLL_S = 0.01


@dataclasses.dataclass
class Stream:
    prompt: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    arrivals: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    """(time.perf_counter(), tokens received so far) per chunk with tokens."""
    error: str | None = None


async def run_stream(stub, name: str, stream: Stream, output_len: int, timeout_s: float) -> None:
    request = generate_request(
        stream.prompt, request_id=name, max_tokens=output_len, temperature=0.0, ignore_eos=True
    )
    try:
        async for chunk in stub.Generate(request, timeout=timeout_s):
            if chunk.token_ids:
                stream.token_ids.extend(chunk.token_ids)
                stream.arrivals.append((time.perf_counter(), len(stream.token_ids)))
    except grpc.aio.AioRpcError as e:
        stream.error = f"{e.code().name}: {e.details()}"


async def _streams_on(router, worker_id: str) -> list[str]:
    """The client ids of the requests the router has on `worker_id` (run on the server's loop)."""
    w = router.workers.get(worker_id)
    if w is None:
        return []
    return sorted(router.requests[r].client_id for r in w.requests if r in router.requests)


async def _decode_load(router) -> dict[str, int]:
    return {w.worker_id: len(w.requests) for w in router.workers.values() if w.role == "decode"}


def worker_pid(server: ServerThread, worker_id: str) -> int:
    actor = server.server.router.workers[worker_id].actor
    return messages.unwrap(dict, ray.get(actor.ready.remote(), timeout=60))["pid"]


async def kill_when_loaded(server: ServerThread, streams: dict[str, Stream], args) -> dict:
    """Waits until a decode worker holds streams that each have `--kill-after` tokens, kills its process;
    returns the victim, its streams and the kill time."""
    router = server.server.router
    give_up = time.perf_counter() + args.timeout
    while time.perf_counter() < give_up:
        load = await asyncio.to_thread(server.call, _decode_load(router))
        victim = max(load, key=load.get, default=None)
        if victim is not None and load[victim]:
            names = await asyncio.to_thread(server.call, _streams_on(router, victim))
            held = [n for n in names if n in streams]
            if held and all(len(streams[n].token_ids) >= args.kill_after for n in held):
                pid = await asyncio.to_thread(worker_pid, server, victim)
                at = {n: len(streams[n].token_ids) for n in held}
                os.kill(pid, signal.SIGKILL)
                killed_at = time.perf_counter()
                return {"victim": victim, "pid": pid, "killed_at": killed_at, "tokens_at_kill": at}
        await asyncio.sleep(_POLL_S)
    raise TimeoutError(f"no decode worker held streams with {args.kill_after} tokens each")


async def load_and_kill(server: ServerThread, prompts: list[list[int]], args) -> tuple[dict, dict]:
    streams = {f"s{i}": Stream(p) for i, p in enumerate(prompts)}
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tasks = [
            asyncio.create_task(run_stream(stub, name, s, args.output_len, args.timeout))
            for name, s in streams.items()
        ]
        start = time.perf_counter()
        kill = await kill_when_loaded(server, streams, args)
        await asyncio.gather(*tasks)
        kill["wall_s"] = time.perf_counter() - start
    return streams, kill


def resume_latencies(streams: dict[str, Stream], kill: dict) -> list[float]:
    """Seconds from the kill to the next token of each stream that was on the victim and had tokens left."""
    out = []
    for name, had in kill["tokens_at_kill"].items():
        after = [t for t, n in streams[name].arrivals if n > had and t >= kill["killed_at"]]
        if after:
            out.append(after[0] - kill["killed_at"])
    return out


def wait_replaced(address: str, victim: str, timeout_s: float) -> dict:
    with Client(address) as client:
        give_up = time.monotonic() + timeout_s
        while True:
            status = client.status()
            found = [w for w in status.lost_workers if w.worker_id == victim]
            if found and (found[0].replaced_by or found[0].not_replaced):
                w = found[0]
                return {
                    "replaced_by": w.replaced_by, "not_replaced": w.not_replaced,
                    "reason": w.reason, "num_requests_migrated": w.num_requests_migrated,
                    "replaced_within_s": w.lost_s_ago,  # of its loss (polled every 0.5 s)
                }  # fmt: skip
            if time.monotonic() > give_up:
                return {"replaced_by": "", "not_replaced": f"not replaced within {timeout_s:g}s"}
            time.sleep(0.5)


def check_offline(args, streams: dict[str, Stream]) -> dict:
    import torch

    from pdserve.engine.offline import OfflineGenerator
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kernels import use_backend, use_batch_invariant
    from pdserve.model.loader import load_model
    from pdserve.model.random_checkpoint import resolve_model

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    differ: dict[str, int] = {}
    start = time.monotonic()
    with use_backend(args.kernels), use_batch_invariant(args.batch_invariant):
        model = load_model(resolve_model(args.model), device, dtype, progress=False)
        generator = OfflineGenerator(model)
        for i, (name, s) in enumerate(streams.items()):
            expected = generator.generate(s.prompt, params).token_ids
            print(f"offline check: {i + 1}/{len(streams)} ({time.monotonic() - start:.0f} s)")
            if expected != s.token_ids:
                pairs = enumerate(zip(expected, s.token_ids, strict=False))
                differ[name] = next((i for i, (a, b) in pairs if a != b), len(s.token_ids))
    return {
        "checked": len(streams),
        "identical": len(streams) - len(differ),
        "first_divergence": differ,
    }


_CHECK_SETTINGS = ("model", "device", "dtype", "kernels", "batch_invariant", "output_len")
"""What the offline check of saved streams must repeat of the run that saved them."""


def check_saved(args) -> int:
    """Checks streams a run saved (--check-file); returns the exit status."""
    saved = json.loads(Path(args.check_file).read_text())
    settings = argparse.Namespace(**saved["settings"])
    names = list(saved["streams"])[args.check_start :][: args.check_n]
    streams = {n: Stream(**saved["streams"][n]) for n in names}
    check = check_offline(settings, streams)
    print(json.dumps({"check_file": args.check_file, "from": args.check_start, **check}, indent=2))
    return int(check["identical"] != check["checked"])


def serve_config(args, num_prefill: int, num_decode: int):
    on_gpu = args.device == "cuda"
    values = {
        "model": {
            "path": args.model, "dtype": args.dtype, "kernels": args.kernels,
            "batch_invariant": args.batch_invariant,
        },
        "cluster": {
            "num_prefill": num_prefill, "num_decode": num_decode, "gpus_per_worker": int(on_gpu),
            "cpus_per_worker": 1.0 if on_gpu else 0.25,
        },
        "router": {"port": 0, "http_port": None, "admission_timeout_s": args.timeout},
        "kvtransfer": {"store_port": free_port()},
    }  # fmt: skip
    if (
        on_gpu
    ):  # decode graphs warmed up for this load only: a replacement's start is part of the test
        values["prefill"] = {"gpu_memory_fraction": args.gpu_memory_fraction}
        values["decode"] = {
            "gpu_memory_fraction": args.gpu_memory_fraction, "max_running": args.streams,
            "warm_up_context": args.input_len + args.output_len,
        }  # fmt: skip
    return build_config(None, values)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="tiny", help="checkpoint directory, or tiny")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where workers run")
    p.add_argument(
        "--dtype", default=None,
        help="activation dtype, as `pdserve serve --model.dtype` (default: auto; fp32 on the CPU)",
    )  # fmt: skip
    p.add_argument("--kernels", default="auto", help="as `pdserve serve --model.kernels`")
    p.add_argument(
        "--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
        help="serve and check in batch-invariant mode (default: on GPUs; fp32 on the CPU needs none)",
    )  # fmt: skip
    p.add_argument(
        "--prefill", type=int, default=None,
        help="prefill workers (default: 1 on the CPU; on GPUs 1 if a third GPU is free, else 0)",
    )  # fmt: skip
    p.add_argument(
        "--decode", type=int, default=2, help="decode workers (at least 2: one is killed)"
    )
    p.add_argument("--gpus", type=int, default=None, help="GPUs for the local Ray (default: all)")
    p.add_argument(
        "--gpu-memory-fraction", type=float, default=0.85,
        help="of each worker's GPU: weights, KV cache and workspace",
    )  # fmt: skip
    p.add_argument("--streams", type=int, default=64, help="greedy streams, all at once")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens per stream (ignore_eos)")
    p.add_argument(
        "--kill-after", type=int, default=None,
        help="kill once each of the victim's streams has this many tokens (default: output-len / 4)",
    )  # fmt: skip
    p.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from [3, vocab)")
    p.add_argument("--timeout", type=float, default=900.0, help="deadline per stream, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--check-n", type=int, default=None,
        help="streams checked against the offline path after serving (default: all; the rest can be "
        "checked later with --check-file)",
    )  # fmt: skip
    p.add_argument(
        "--check-file", default=None,
        help="no serving: check the streams a run saved ($OUT/migration_streams.json) against the offline "
        "path, those from --check-start on (--check-n of them)",
    )  # fmt: skip
    p.add_argument("--check-start", type=int, default=0, help="with --check-file: first stream")
    args = p.parse_args()
    if args.check_file is not None:
        sys.exit(check_saved(args))
    if args.decode < 2:
        p.error(f"--decode {args.decode}: at least 2 (one is killed, another serves meanwhile)")
    if args.streams < 1 or args.output_len < 2 or args.input_len < 1:
        p.error("--streams and --input-len must be positive, --output-len at least 2")
    args.kill_after = args.output_len // 4 if args.kill_after is None else args.kill_after
    on_gpu = args.device == "cuda"
    args.dtype = args.dtype or ("auto" if on_gpu else "fp32")
    args.batch_invariant = on_gpu if args.batch_invariant is None else args.batch_invariant
    if not 1 <= args.kill_after < args.output_len:
        p.error(f"--kill-after {args.kill_after}: must be in [1, --output-len)")

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.device == "cuda":
        import torch

        num_gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
        if num_gpus < 2:
            sys.exit(
                f"--device cuda needs 2 GPUs, {num_gpus} visible (use --device cpu for the smoke test)"
            )
        num_prefill = int(num_gpus > args.decode) if args.prefill is None else args.prefill
        if num_prefill + args.decode > num_gpus:
            sys.exit(
                f"{num_prefill} prefill + {args.decode} decode workers need a GPU each: {num_gpus}"
            )
        ray.init(address="local", num_gpus=num_gpus, include_dashboard=False)
    else:
        num_prefill = 1 if args.prefill is None else args.prefill
        ray.init(address="local", num_cpus=2, include_dashboard=False)

    rng = random.Random(args.seed)
    prompts = [
        [0, *(rng.randrange(3, args.vocab) for _ in range(args.input_len - 1))]
        for _ in range(args.streams)
    ]
    config = serve_config(args, num_prefill, args.decode)
    print(
        f"serving {args.model}: {num_prefill} prefill + {args.decode} decode workers on {args.device}"
    )
    with ServerThread(config) as server:
        streams, kill = asyncio.run(load_and_kill(server, prompts, args))
        replaced = wait_replaced(server.address, kill["victim"], args.timeout)
    ray.shutdown()

    latencies = np.array(resume_latencies(streams, kill)) * 1e3
    failed = {n: s.error for n, s in streams.items() if s.error is not None}
    summary = {
        "model": args.model, "device": args.device, "batch_invariant": args.batch_invariant,
        "num_prefill": num_prefill, "num_decode": args.decode, "streams": args.streams,
        "input_len": args.input_len, "output_len": args.output_len,
        "victim": kill["victim"], "streams_on_victim": len(kill["tokens_at_kill"]),
        "migrated_resumed": len(latencies),
        "resume_ms_p50": float(np.percentile(latencies, 50)) if len(latencies) else None,
        "resume_ms_p99": float(np.percentile(latencies, 99)) if len(latencies) else None,
        "resume_ms_max": float(latencies.max()) if len(latencies) else None,
        "wall_s": kill["wall_s"], "errors": len(failed),
        "first_error": next(iter(failed.values()), None), "replacement": replaced,
    }  # fmt: skip
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out is not None:
        saved = {
            "settings": {k: getattr(args, k) for k in _CHECK_SETTINGS},
            "streams": {
                n: {"prompt": s.prompt, "token_ids": s.token_ids} for n, s in streams.items()
            },
        }
        (out / "migration_streams.json").write_text(json.dumps(saved) + "\n")
    checked = dict(list(streams.items())[: args.check_n])
    summary["offline_check"] = check_offline(args, checked)
    for key, value in summary.items():
        print(f"{key:>18}: {value:.3f}" if isinstance(value, float) else f"{key:>18}: {value}")
    text = json.dumps(summary, indent=2)
    print(text)
    if out is not None:
        (out / "migration.json").write_text(text + "\n")
        print(f"wrote {out / 'migration.json'} and {out / 'migration_streams.json'}")
    check = summary["offline_check"]
    if failed or check["identical"] != check["checked"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
