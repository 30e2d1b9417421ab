"""`pdserve demo`: the embedded default end to end on this machine. Starts a local Ray and the server (tiny model,
one prefill and one decode worker, on the CPU unless GPUs are present), streams a few generations through the gRPC
API printing their time to first token and tokens/s, and shuts everything down."""

from __future__ import annotations

import sys
import time

import ray

from pdserve.cli.client import FINISH_REASONS, Client, generate_request
from pdserve.cluster.config import ServeConfig
from pdserve.cluster.ray_connect import connect_ray
from pdserve.frontend.server import ServerThread

PROMPTS = (
    "The quick brown fox",
    "Disaggregated serving splits prefill and decode because",
    "Once upon a time",
)


def run_demo(config: ServeConfig, max_tokens: int = 32, out=sys.stdout) -> int:
    """Serves `config` (its ports should be free or 0), generates for PROMPTS, stops. Returns an exit code."""
    start = time.perf_counter()
    connect_ray(config)
    try:
        with ServerThread(config) as server:
            print(f"server up on {server.address} in {time.perf_counter() - start:.1f}s", file=out)
            if config.model.path == "tiny":
                print("(the tiny model has random weights: its text is noise)", file=out)
            with Client(server.address) as client:
                for prompt in PROMPTS:
                    _generate(client, prompt, max_tokens, out)
                print(_status_line(client), file=out)
    finally:
        ray.shutdown()
    print(f"demo done in {time.perf_counter() - start:.1f}s", file=out)
    return 0


def _generate(client: Client, prompt: str, max_tokens: int, out) -> None:
    sent = time.perf_counter()
    first = None
    pieces: list[str] = []
    print(f"\n> {prompt}", file=out)
    request = generate_request(prompt, max_tokens=max_tokens, ignore_eos=True, seed=0)
    for chunk in client.generate(request, timeout_s=120):
        if first is None and chunk.token_ids:
            first = time.perf_counter()
        pieces.append(chunk.text)
        print(chunk.text, end="", flush=True, file=out)
        last = chunk
    done = time.perf_counter()
    n = last.usage.completion_tokens
    rate = (n - 1) / (done - first) if n > 1 and done > first else 0.0
    print(
        f"\n[{last.usage.prompt_tokens} prompt tokens, {n} generated, finish_reason="
        f"{FINISH_REASONS.get(last.finish_reason, '?')}, TTFT {1e3 * (first - sent):.0f} ms, "
        f"{rate:.1f} tokens/s, served by {last.timings.prefill_worker or 'local prefill'} -> "
        f"{last.timings.decode_worker}]",
        file=out,
    )


def _status_line(client: Client) -> str:
    status = client.status()
    workers = [w for pool in status.pools for w in pool.workers]
    used = sum(w.kv_pages_used for w in workers)
    return f"\n{len(workers)} workers, {used} KV pages in use after the demo (expected 0)"
