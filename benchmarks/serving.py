"""Serving benchmark: N streamed Generate calls over gRPC against a running `pdserve serve`, closed-loop (at most
--concurrency in flight) or open-loop (Poisson arrivals at --request-rate, each request sent on time whatever is
in flight).

    python benchmarks/serving.py --addr 127.0.0.1:50051 --num-requests 256 --concurrency 64 \
        --input-len 1024 --output-len 256 [--check-offline --model DIR --dtype bf16]
    python benchmarks/serving.py --request-rate 16 --num-requests 256 --warmup 0 --repeat 2 \
        --slo-ttft-ms 2000 --slo-tpot-ms 30

With SLOs given, goodput is the share of requests (and their rate) that met both. --repeat runs the identical
timed load again (same prompts, same arrival times) and reports every run: the first run right after the server
says SERVING against the next shows what a cold server costs.

Every request is greedy with ignore_eos, so each generates exactly --output-len tokens. Prints TTFT p50/p99, TPOT
(time per output token after the first) p50/p99, output tokens/s and requests/s over the timed run, after
--warmup requests that are not timed. --check-offline regenerates the first --check-n prompts with the offline
path (`pdserve offline`'s, in this process, on --device) and reports how many outputs are identical and where the
first divergence is (bf16 batching may legitimately diverge late; fp32 on CPU must match exactly). Writes
$OUT/serving.json when OUT is set."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.client import generate_request
from pdserve.v1 import generation_pb2_grpc


@dataclasses.dataclass
class Result:
    prompt: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    ttft_s: float = 0.0
    tpot_s: float | None = None
    error: str | None = None


async def one(
    stub, request_id: str, prompt: list[int], output_len: int, timeout_s: float
) -> Result:
    result = Result(prompt)
    request = generate_request(
        prompt, request_id=request_id, max_tokens=output_len, temperature=0.0, ignore_eos=True
    )
    start = time.perf_counter()
    first = last = None
    try:
        async for chunk in stub.Generate(request, timeout=timeout_s):
            now = time.perf_counter()
            if chunk.token_ids and first is None:
                first = now
            last = now
            result.token_ids.extend(chunk.token_ids)
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
        return result
    result.ttft_s = first - start
    if len(result.token_ids) > 1:
        result.tpot_s = (last - first) / (len(result.token_ids) - 1)
    return result


def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0, *(rng.randrange(3, vocab) for _ in range(input_len - 1))] for _ in range(n)]


def arrival_times(n: int, rate: float | None, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process at `rate` requests/s; all 0 when rate is None."""
    if rate is None:
        return [0.0] * n
    rng, t, out = random.Random(seed + 1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run(args) -> list[dict]:
    prompts = make_prompts(args.num_requests + args.warmup, args.input_len, args.vocab, args.seed)
    arrivals = arrival_times(args.num_requests, args.request_rate, args.seed)
    async with grpc.aio.insecure_channel(args.addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            sys.exit(f"{args.addr} is not SERVING")
        stub = generation_pb2_grpc.GenerationStub(channel)
        limit = asyncio.Semaphore(args.concurrency)

        async def bounded(i: int, prompt: list[int], at: float = 0.0, start: float = 0.0) -> Result:
            if args.request_rate is not None:  # open loop: sent on time, never held back
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                return await one(stub, f"bench-{i}", prompt, args.output_len, args.timeout)
            async with limit:
                return await one(stub, f"bench-{i}", prompt, args.output_len, args.timeout)

        warm = prompts[: args.warmup]
        await asyncio.gather(*(bounded(-i - 1, p) for i, p in enumerate(warm)))
        summaries = []
        for repeat in range(args.repeat):
            start = time.perf_counter()
            timed = prompts[args.warmup :]
            results = await asyncio.gather(
                *(
                    bounded(repeat * len(timed) + i, p, at, start)
                    for i, (p, at) in enumerate(zip(timed, arrivals, strict=True))
                )
            )
            wall = time.perf_counter() - start
            summaries.append(summarize(args, results, wall, repeat))
    return summaries


def summarize(args, results: list[Result], wall: float, repeat: int) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = np.array([r.ttft_s for r in ok]) * 1e3
    tpot = np.array([r.tpot_s for r in ok if r.tpot_s is not None]) * 1e3
    out_tokens = sum(len(r.token_ids) for r in ok)
    summary = {
        "run": repeat + 1,
        "addr": args.addr,
        "num_requests": args.num_requests,
        "request_rate": args.request_rate,
        "concurrency": None if args.request_rate is not None else args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "wall_s": wall,
        "ttft_ms_p50": float(np.percentile(ttft, 50)) if len(ttft) else None,
        "ttft_ms_p99": float(np.percentile(ttft, 99)) if len(ttft) else None,
        "tpot_ms_p50": float(np.percentile(tpot, 50)) if len(tpot) else None,
        "tpot_ms_p99": float(np.percentile(tpot, 99)) if len(tpot) else None,
        "output_tokens_per_s": out_tokens / wall,
        "requests_per_s": len(ok) / wall,
    }
    if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
        good = [
            r for r in ok
            if (args.slo_ttft_ms is None or 1e3 * r.ttft_s <= args.slo_ttft_ms)
            and (args.slo_tpot_ms is None or r.tpot_s is None or 1e3 * r.tpot_s <= args.slo_tpot_ms)
        ]  # fmt: skip
        summary["slo"] = f"TTFT <= {args.slo_ttft_ms} ms, TPOT <= {args.slo_tpot_ms} ms"
        summary["goodput_share"] = len(good) / len(results)
        summary["goodput_requests_per_s"] = len(good) / wall
    if args.check_offline and repeat == 0:
        summary["offline_check"] = check_offline(args, ok[: args.check_n])
    return summary


def check_offline(args, results: list[Result]) -> dict:
    import torch

    from pdserve.engine.offline import OfflineGenerator
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kernels import use_backend, use_batch_invariant
    from pdserve.model.loader import load_model
    from pdserve.model.random_checkpoint import resolve_model

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    identical, divergences = 0, []
    with use_backend(args.kernels), use_batch_invariant(args.batch_invariant):
        model = load_model(resolve_model(args.model), args.device, dtype, progress=False)
        generator = OfflineGenerator(model, kv_cache_dtype=args.kv_cache_dtype)
        for r in results:
            expected = generator.generate(r.prompt, params).token_ids
            if expected == r.token_ids:
                identical += 1
            else:
                pairs = enumerate(zip(expected, r.token_ids, strict=False))
                divergences.append(next((i for i, (a, b) in pairs if a != b), len(r.token_ids)))
    return {"checked": len(results), "identical": identical, "first_divergence_at": divergences}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument(
        "--concurrency", type=int, default=32, help="closed loop: streams in flight at once"
    )
    p.add_argument(
        "--request-rate", type=float, default=None,
        help="open loop: Poisson arrivals at this many requests/s (--concurrency is then ignored)",
    )  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT bound")
    p.add_argument("--repeat", type=int, default=1, help="timed runs of the identical load")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from [3, vocab)")
    p.add_argument("--warmup", type=int, default=4, help="untimed requests first")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline per request, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--check-offline", action="store_true", help="compare outputs with the offline path"
    )
    p.add_argument("--check-n", type=int, default=8, help="requests to check")
    p.add_argument("--model", default="tiny", help="for --check-offline: the served checkpoint")
    p.add_argument("--dtype", default="auto", help="for --check-offline: as served")
    p.add_argument("--kernels", default="auto", help="for --check-offline: as served")
    p.add_argument("--device", default="cpu", help="for --check-offline: cpu or cuda[:N]")
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
        help="for --check-offline: as served with --model.kv-cache-dtype",
    )  # fmt: skip
    p.add_argument(
        "--batch-invariant", action="store_true",
        help="for --check-offline: as served with --model.batch-invariant true",
    )  # fmt: skip
    args = p.parse_args()
    if args.request_rate is not None and args.request_rate <= 0:
        p.error(f"--request-rate {args.request_rate}: must be positive")
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: must be at least 1")
    summaries = asyncio.run(run(args))
    for summary in summaries:
        for key, value in summary.items():
            print(f"{key:>22}: {value:.3f}" if isinstance(value, float) else f"{key:>22}: {value}")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "serving.json"
        path.write_text(json.dumps(summaries if args.repeat > 1 else summaries[0], indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
