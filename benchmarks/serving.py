"""Serving benchmark: N streamed requests against a running `pdserve serve`, over gRPC (Generate) or its
OpenAI-compatible HTTP API (/v1/completions, server-sent events), closed-loop (at most --concurrency in flight) or
open-loop (Poisson arrivals at --request-rate, each request sent on time whatever is in flight); or a sweep over
rates or concurrencies that writes JSON and a PNG plot.

    python benchmarks/serving.py --addr 127.0.0.1:50051 --duration 60 --concurrency 64 \
        --input-len 1024 --output-len 256 [--check-offline --model DIR --dtype bf16]
    python benchmarks/serving.py --protocol http --base-url http://127.0.0.1:8000/v1 --request-rate 16 \
        --duration 120 --warmup-s 20 --goodput ttft:2000 tpot:30
    python benchmarks/serving.py --sweep-rates 4,8,16,32 --num-gpus 2 --goodput ttft:2000 tpot:30 \
        --sweep-out benchmarks/figures/sweep  # writes sweep.json and sweep.png

Steady state (the default): each load runs --warmup-s seconds of arrivals that are sent but not measured, then
--duration seconds (default 60) that are: the figures are those of the requests sent in that window, and output
tokens/s counts the tokens that arrived within it. The report says whether the offered load was held: open loop,
whether requests completed within the window at the offered rate (within 5%) and TTFT did not climb across it
(the second half's median at most 1.5x the first half's plus 50 ms); closed loop, whether TTFT did not climb.
--num-requests N runs a fixed count instead (a few seconds of requests mislead: it is marked steady_state false).

Per request: TTFT (to the first chunk with tokens), TPOT (time per output token after the first), ITL (gaps
between chunks) and end-to-end latency; printed as p50/p99 with output tokens/s and requests/s over the timed run,
after --warmup requests that are not timed. Goodput (DistServe's definition): completed requests per second that
met every bound given with --goodput (`ttft:MS`, `tpot:MS`, `e2el:MS`), and their share. --repeat runs the identical
timed load again (same prompts, same arrival times) and reports every run: the first run right after the server
says SERVING against the next shows what a cold server costs.

A sweep (--sweep-rates or --sweep-concurrency) runs one timed load per point and plots output tokens/s per GPU
(--num-gpus) against tokens/s per user (1 / median TPOT), and goodput against the swept value; the plot needs
matplotlib (`pip install .[benchmarks]`), the JSON does not.

Every request is greedy with ignore_eos, so each generates exactly --output-len tokens. --check-offline
regenerates the first --check-n prompts with the offline path (`pdserve offline`'s, in this process, on --device)
and reports how many outputs are identical and where the first divergence is (bf16 batching may legitimately
diverge late; fp32 on CPU must match exactly; gRPC only: HTTP returns text). Writes $OUT/serving.json when OUT is
set."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from _sse import HttpStatusError, post_events
from _sweep_plot import plot_files, plot_sweep
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cli.client import generate_request
from pdserve.v1 import generation_pb2_grpc


@dataclasses.dataclass
class Result:
    prompt: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None
    sent_at: float = 0.0
    """perf_counter() when the request was sent."""
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    """perf_counter() at each chunk with tokens."""

    def timed(self, start: float, chunk_times: list[float]) -> Result:
        """Fills the latencies from the send time and the arrival of each chunk with tokens."""
        self.sent_at, self.chunk_times = start, chunk_times
        first, last = chunk_times[0], chunk_times[-1]
        self.ttft_s, self.e2e_s = first - start, last - start
        self.itl_s = list(np.diff(chunk_times))
        if self.num_tokens > 1:
            self.tpot_s = (last - first) / (self.num_tokens - 1)
        return self


async def one_grpc(stub, request_id: str, prompt: list[int], args) -> Result:
    result = Result(prompt, sent_at=time.perf_counter())
    request = generate_request(
        prompt, request_id=request_id, max_tokens=args.output_len, temperature=0.0, ignore_eos=True
    )
    start, times = time.perf_counter(), []
    try:
        async for chunk in stub.Generate(request, timeout=args.timeout):
            if chunk.token_ids:
                times.append(time.perf_counter())
                result.token_ids.extend(chunk.token_ids)
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
        return result
    result.num_tokens = len(result.token_ids)
    result.sent_at = start
    return result.timed(start, times) if times else result


async def one_http(model: str, prompt: list[int], args) -> Result:
    """A streamed /v1/completions; the token count comes from the usage chunk (chunks carry text)."""
    result = Result(prompt, sent_at=time.perf_counter())
    body = {
        "model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start, times = time.perf_counter(), []
    try:
        async with asyncio.timeout(args.timeout):
            async for _, payloads in post_events(args.base_url, "/completions", body, args.api_key):
                now = time.perf_counter()
                for payload in payloads:
                    if payload == b"[DONE]":
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        raise HttpStatusError(event["error"].get("message", str(event)))
                    if event.get("usage"):
                        result.num_tokens = event["usage"]["completion_tokens"]
                    if event["choices"] and event["choices"][0]["text"]:
                        times.append(now)
    except (HttpStatusError, OSError, TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.sent_at = start
    return result.timed(start, times) if times else result


def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0, *(rng.randrange(3, vocab) for _ in range(input_len - 1))] for _ in range(n)]


def arrivals_until(seconds: float, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process at `rate` requests/s over [0, seconds)."""
    rng, t, out = random.Random(seed + 1), 0.0, []
    while t < seconds:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def arrival_times(n: int, rate: float | None, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process at `rate` requests/s; all 0 when rate is None."""
    if rate is None:
        return [0.0] * n
    rng, t, out = random.Random(seed + 1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _served_model(args) -> str:
    def models() -> str:
        request = urllib.request.Request(args.base_url.rstrip("/") + "/models")
        if args.api_key:
            request.add_header("authorization", f"Bearer {args.api_key}")
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())["data"][0]["id"]

    try:
        return await asyncio.to_thread(models)
    except OSError as e:
        sys.exit(f"{args.base_url}/models: {e}")


async def run(args, point: dict | None = None) -> list[dict]:
    """The timed runs of one load (`point` overrides request_rate or concurrency for a sweep)."""
    args = argparse.Namespace(**{**vars(args), **(point or {})})
    count = args.num_requests or 0
    prompts = make_prompts(count + args.warmup, args.input_len, args.vocab, args.seed)
    arrivals = arrival_times(count, args.request_rate, args.seed)
    async with grpc.aio.insecure_channel(args.addr) as channel:
        if args.protocol == "grpc":
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                sys.exit(f"{args.addr} is not SERVING")
            stub = generation_pb2_grpc.GenerationStub(channel)

            def send(i: int, prompt: list[int]):
                return one_grpc(stub, f"bench-{i}", prompt, args)
        else:
            model = await _served_model(args)

            def send(i: int, prompt: list[int]):
                return one_http(model, prompt, args)

        limit = asyncio.Semaphore(args.concurrency)

        async def bounded(i: int, prompt: list[int], at: float = 0.0, start: float = 0.0) -> Result:
            if args.request_rate is not None:  # open loop: sent on time, never held back
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                return await send(i, prompt)
            async with limit:
                return await send(i, prompt)

        if args.num_requests is None:  # steady state: a window of a load already running
            return [await _steady(args, send, repeat) for repeat in range(args.repeat)]
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


async def _steady(args, send, repeat: int) -> dict:
    """One steady-state load: --warmup-s seconds of arrivals, then --duration measured (see the module
    docstring); the requests still in flight at the window's end are awaited (their tokens past it not counted)."""
    total = args.warmup_s + args.duration
    rng = random.Random(args.seed + repeat)
    ids = iter(range(10**9))

    def prompt() -> list[int]:
        return [0, *(rng.randrange(3, args.vocab) for _ in range(args.input_len - 1))]

    start = time.perf_counter()
    if args.request_rate is not None:  # open loop: each sent on time, whatever is in flight

        async def at(t: float) -> Result:
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            return await send(next(ids), prompt())

        results = await asyncio.gather(
            *(at(t) for t in arrivals_until(total, args.request_rate, args.seed + repeat))
        )
    else:  # closed loop: each of --concurrency streams sends its next request when one ends

        async def stream() -> list[Result]:
            done = []
            while time.perf_counter() - start < total:
                done.append(await send(next(ids), prompt()))
            return done

        results = [
            r
            for rs in await asyncio.gather(*(stream() for _ in range(args.concurrency)))
            for r in rs
        ]
    return summarize_window(args, results, start + args.warmup_s, start + total, repeat)


def summarize_window(args, results: list[Result], lo: float, hi: float, repeat: int) -> dict:
    """The summary of the requests sent in [lo, hi), with output tokens/s over the tokens that arrived in it and
    whether the load was held (see the module docstring)."""
    window = hi - lo
    measured = [r for r in results if lo <= r.sent_at < hi]
    summary = summarize(args, measured, window, repeat)
    tokens = 0.0
    for r in results:
        if r.error is None and r.chunk_times:
            per_chunk = r.num_tokens / len(r.chunk_times)
            tokens += per_chunk * sum(lo <= t < hi for t in r.chunk_times)
    ok = [r for r in measured if r.error is None]
    completed = sum(
        1 for r in results if r.error is None and r.chunk_times and lo <= r.chunk_times[-1] < hi
    )
    half = lo + window / 2
    first = [r.ttft_s for r in ok if r.sent_at < half]
    second = [r.ttft_s for r in ok if r.sent_at >= half]
    p50 = {
        k: float(np.median(v)) * 1e3 if v else None
        for k, v in (("first", first), ("second", second))
    }
    climbing = None not in p50.values() and p50["second"] > 1.5 * p50["first"] + 50.0
    summary.update(
        steady_state=True,
        warmup_s=args.warmup_s,
        window_s=window,
        num_requests=len(measured),
        arrival_rate=len(measured) / window,
        completion_rate=completed / window,
        ttft_ms_p50_first_half=p50["first"],
        ttft_ms_p50_second_half=p50["second"],
        output_tokens_per_s=tokens / window,
        output_tokens_per_s_per_gpu=tokens / window / args.num_gpus,
    )
    held = not climbing and not summary["errors"]
    if args.request_rate is not None:
        held = held and completed >= 0.95 * args.request_rate * window
    summary["load_held"] = held
    return summary


def _percentiles(summary: dict, name: str, values_s: list[float]) -> None:
    values = np.array(values_s) * 1e3
    for q in (50, 99):
        summary[f"{name}_ms_p{q}"] = float(np.percentile(values, q)) if len(values) else None


def meets_goodput(r: Result, bounds_ms: dict[str, float]) -> bool:
    """Whether a completed request met every bound (DistServe's goodput: all SLOs at once)."""
    measured = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2el": r.e2e_s}
    return all(measured[k] is None or 1e3 * measured[k] <= bound for k, bound in bounds_ms.items())


def summarize(args, results: list[Result], wall: float, repeat: int) -> dict:
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.num_tokens for r in ok)
    summary = {
        "run": repeat + 1,
        "protocol": args.protocol,
        "addr": args.addr if args.protocol == "grpc" else args.base_url,
        "steady_state": False,
        "num_requests": len(results),
        "request_rate": args.request_rate,
        "concurrency": None if args.request_rate is not None else args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "wall_s": wall,
    }
    _percentiles(summary, "ttft", [r.ttft_s for r in ok])
    _percentiles(summary, "tpot", [r.tpot_s for r in ok if r.tpot_s is not None])
    _percentiles(summary, "itl", [gap for r in ok for gap in r.itl_s])
    _percentiles(summary, "e2el", [r.e2e_s for r in ok])
    summary["output_tokens_per_s"] = out_tokens / wall
    summary["output_tokens_per_s_per_gpu"] = out_tokens / wall / args.num_gpus
    median_tpot_ms = summary["tpot_ms_p50"]
    summary["tokens_per_s_per_user"] = 1e3 / median_tpot_ms if median_tpot_ms else None
    summary["requests_per_s"] = len(ok) / wall
    if args.keep_latencies:  # [TTFT, TPOT] ms of each request that completed (TPOT null: one token)
        summary["latencies_ms"] = [
            [round(1e3 * r.ttft_s, 2), None if r.tpot_s is None else round(1e3 * r.tpot_s, 3)]
            for r in ok
        ]
    if args.goodput:
        good = [r for r in ok if meets_goodput(r, args.goodput)]
        summary["goodput_slo"] = " ".join(f"{k}<={v:g}ms" for k, v in args.goodput.items())
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


GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`ttft:2000 tpot:30` -> {"ttft": 2000.0, "tpot": 30.0}; ValueError naming the bad item."""
    bounds = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"{item!r}: expected KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}")
        try:
            bounds[key] = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number of milliseconds") from None
        if bounds[key] <= 0:
            raise ValueError(f"{item!r}: the bound must be positive")
    return bounds


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--protocol", default="grpc", choices=["grpc", "http"])
    p.add_argument("--addr", default="127.0.0.1:50051", help="gRPC address")
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000/v1", help="HTTP: the OpenAI API's base URL"
    )
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"), help="HTTP: bearer key")
    p.add_argument(
        "--duration", type=float, default=60.0,
        help="steady state: seconds of arrivals measured, after --warmup-s (default 60)",
    )  # fmt: skip
    p.add_argument(
        "--warmup-s", type=float, default=10.0,
        help="steady state: seconds of arrivals sent first and not measured (default 10)",
    )  # fmt: skip
    p.add_argument(
        "--num-requests", type=int, default=None,
        help="a fixed count of timed requests instead of the steady-state window (marked steady_state false)",
    )  # fmt: skip
    p.add_argument(
        "--concurrency", type=int, default=32, help="closed loop: streams in flight at once"
    )
    p.add_argument(
        "--request-rate", type=float, default=None,
        help="open loop: Poisson arrivals at this many requests/s (--concurrency is then ignored)",
    )  # fmt: skip
    p.add_argument(
        "--goodput", nargs="+", default=[], metavar="KEY:MS",
        help="SLO bounds for goodput: ttft:MS tpot:MS e2el:MS (any of them)",
    )  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="the same as --goodput ttft:MS")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="the same as --goodput tpot:MS")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs serving: for tokens/s per GPU")
    p.add_argument(
        "--keep-latencies", action="store_true",
        help="keep each completed request's [TTFT, TPOT] in ms in the summary (`latencies_ms`), so that "
        "goodput can be read later at any SLO (benchmarks/ratio_study.py)",
    )  # fmt: skip
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--sweep-rates", default=None, help="comma-separated request rates")
    sweep.add_argument("--sweep-concurrency", default=None, help="comma-separated concurrencies")
    sweep.add_argument(
        "--plot-from", nargs="+", default=None, metavar="FILE.json[=LABEL]",
        help="no load: plot sweeps already written into one figure (--sweep-out PREFIX.png)",
    )  # fmt: skip
    p.add_argument(
        "--sweep-out", default=None,
        help="sweep: write PREFIX.json and PREFIX.png (default $OUT/sweep, else ./sweep)",
    )  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="timed runs of the identical load")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from [3, vocab)")
    p.add_argument("--warmup", type=int, default=4, help="--num-requests: untimed requests first")
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
    if args.duration <= 0 or args.warmup_s < 0:
        p.error(
            f"--duration {args.duration} must be positive and --warmup-s {args.warmup_s} at least 0"
        )
    if args.num_requests is not None and args.num_requests < 1:
        p.error(f"--num-requests {args.num_requests}: must be at least 1")
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: must be at least 1")
    if args.num_gpus < 1:
        p.error(f"--num-gpus {args.num_gpus}: must be at least 1")
    if args.check_offline and args.protocol != "grpc":
        p.error("--check-offline compares token ids: gRPC only")
    try:
        args.goodput = parse_goodput(args.goodput)
        for key, bound in (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms)):
            if bound is not None:
                args.goodput.update(parse_goodput([f"{key}:{bound}"]))
    except ValueError as e:
        p.error(f"--goodput {e}")
    if args.plot_from:
        plot_files(
            p, args.plot_from, Path(args.sweep_out or Path(os.environ.get("OUT", ".")) / "sweep")
        )
        return
    if args.sweep_rates or args.sweep_concurrency:
        sweep_main(p, args)
        return
    summaries = asyncio.run(run(args))
    for summary in summaries:
        print_summary(summary)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "serving.json"
        path.write_text(json.dumps(summaries if args.repeat > 1 else summaries[0], indent=2) + "\n")
        print(f"wrote {path}")


def print_summary(summary: dict) -> None:
    for key, value in summary.items():
        print(f"{key:>28}: {value:.3f}" if isinstance(value, float) else f"{key:>28}: {value}")


def sweep_main(p: argparse.ArgumentParser, args) -> None:
    swept = "request_rate" if args.sweep_rates else "concurrency"
    text = args.sweep_rates or args.sweep_concurrency
    try:
        values = [float(x) if swept == "request_rate" else int(x) for x in text.split(",")]
    except ValueError:
        p.error(f"--sweep-{'rates' if args.sweep_rates else 'concurrency'} {text!r}: not numbers")
    if any(v <= 0 for v in values):
        p.error(f"sweep values must be positive: {text}")
    prefix = Path(args.sweep_out or Path(os.environ.get("OUT", ".")) / "sweep")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    points = []
    for value in values:
        point = {"request_rate": value} if swept == "request_rate" else {"concurrency": value}
        if swept == "concurrency":
            point["request_rate"] = None
        (summary,) = asyncio.run(run(argparse.Namespace(**{**vars(args), "repeat": 1}), point))
        points.append(summary)
        good = summary.get("goodput_requests_per_s")
        print(
            f"{swept} {value:g}: {summary['output_tokens_per_s_per_gpu']:.1f} output tok/s/GPU, "
            f"{summary['tokens_per_s_per_user'] or 0:.1f} tok/s/user, TTFT p50 "
            f"{summary['ttft_ms_p50'] or 0:.0f} ms, TPOT p50 {summary['tpot_ms_p50'] or 0:.1f} ms"
            + (f", goodput {good:.2f} req/s ({100 * summary['goodput_share']:.0f}%)" if args.goodput else "")
            + f", errors {summary['errors']}"
            + (f", load held: {summary['load_held']}" if summary["steady_state"] else ""),
            flush=True,
        )  # fmt: skip
    per_point = (
        f"{args.num_requests} requests"
        if args.num_requests is not None
        else f"{args.duration:g} s measured after {args.warmup_s:g} s"
    )
    title = (
        f"{args.protocol}, ISL {args.input_len} / OSL {args.output_len}, "
        f"{per_point} per point, {args.num_gpus} GPU(s)"
    )
    record = {
        "title": title,
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "swept": swept,
        "num_gpus": args.num_gpus,
        "points": points,
    }
    prefix.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {prefix.with_suffix('.json')}")
    if plot_sweep({"": points}, swept, prefix.with_suffix(".png"), title):
        print(f"wrote {prefix.with_suffix('.png')}")


if __name__ == "__main__":
    main()
