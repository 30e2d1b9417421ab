"""The KV rendezvous store under attack while requests flow: `pdserve serve` (in this process, on a local Ray) with
one prefill and one decode worker, and an attacker process that knows the store's address but not the
deployment's secret. Phases, each `--phase-s` long, with a request started every `--every-s` (greedy, ignore_eos):

- `baseline`: no attack, the normal latency;
- `bump`: every `--period-ms`, each pair's epoch key (named after the pair's other keys, there or not) raised
  with add when it holds a number (an unsigned counter), else set to a larger number;
- `forge`: every value replaced by bytes of a signed value's shape;
- `replay`: every value replaced by one seen earlier under another key (another epoch's), the epoch key set back
  to the oldest value seen, and the next epoch's keys written ahead;
- `delete`: every key deleted (last: nothing is left to tamper with until a rebuild writes keys again).

The attacker lists the keys itself (TCPStore shows every key to every client). The pair's link is built during
the warm-up, so the attack meets an established link, as it would on a serving cluster most of the time: a
rebuild under attack is in tests/kvtransfer/test_tamper.py. Reports, per phase:
requests, failed, latency p50/max, the delay beyond the baseline's median (max), and how many were delayed more
than 2 s; exits 1 when a request failed or was delayed more than 2 s. Writes $OUT/kv_tamper.json when OUT is set.

    python benchmarks/kv_tamper.py                      # CPU, tiny model
    python benchmarks/kv_tamper.py --phase-s 6 --period-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import random
import re
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import grpc
import ray

from pdserve.cli.client import generate_request
from pdserve.cluster.config import build_config
from pdserve.frontend.server import ServerThread, free_port
from pdserve.v1 import generation_pb2_grpc

PHASES = ("baseline", "bump", "forge", "replay", "delete")
DELAY_LIMIT_S = 2.0


class Attacker:
    """A process with a client of the store and no secret, forked before Ray starts (a spawned one would import
    this script's world, seconds of CPU that would weigh on the phase it starts in). Idle until told a mode."""

    def __init__(self, port: int, period_s: float):
        ctx = mp.get_context("fork")
        self.mode = ctx.Value("i", 0)
        self.acts = ctx.Array("l", len(PHASES))
        self.quit = ctx.Event()
        self.proc = ctx.Process(
            target=_attack, args=(port, period_s, self.mode, self.acts, self.quit), daemon=True
        )
        self.proc.start()

    def set(self, phase: str) -> None:
        self.mode.value = PHASES.index(phase)

    def close(self) -> None:
        self.quit.set()
        self.proc.join(timeout=30)


def _attack(port: int, period_s: float, mode, acts, quit_) -> None:
    import torch.distributed as dist

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # torch logs a stalled connect with a stack trace
    rng, seen, created, store = random.Random(0), {}, set(), None
    while not quit_.wait(period_s):
        phase = PHASES[mode.value]
        if phase == "baseline":
            continue
        try:
            if store is None:
                store = dist.TCPStore(
                    "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                    wait_for_workers=False,
                )  # fmt: skip
            acts[mode.value] += _tamper(store, phase, rng, seen, created)
        except dist.DistError:  # a connect stalled, or the store is gone: a new client
            store = None


def _read(store, key: str) -> bytes | None:
    value = store.compare_set(key, "\x01", "\x01")  # reads without waiting for a missing key
    return None if value == b"\x01" else value


def _tamper(store, phase: str, rng: random.Random, seen: dict, created: set) -> int:
    """One round of `phase` on the pdserve keys the store lists; returns how many keys it touched."""
    keys = [k for k in store.list_keys() if "pdkv/" in k]
    for key in keys:
        value = _read(store, key)
        if value is not None:
            seen.setdefault(key, set()).add(value)
    if phase == "bump":  # every pair's epoch, whether or not the key is there yet
        keys = sorted(
            {m[1] + "/epoch" for k in keys if (m := re.match(r"^(.*pdkv/[^/]+/[^/]+)/", k))}
        )
    acts = 0
    for key in keys:
        acts += 1
        if phase == "delete":
            store.delete_key(key)
        elif phase == "forge":
            store.set(key, bytes(rng.choice(b"0123456789abcdef") for _ in range(64)) + b"1")
        elif phase == "bump":
            value = _read(store, key)
            if value is not None and value.isdigit():  # an unsigned counter: move it
                store.add(key, 1)
            else:  # a signed value, or none: a larger number in its place (raised with add next round)
                store.set(key, str(rng.randrange(10**6)))
        elif phase == "replay" and key not in created:
            tail = re.sub(r"^.*pdkv/[^/]+/[^/]+/(\d+/)?", "", key)
            if key.endswith("/epoch"):
                pool = sorted(seen.get(key, ()), key=lambda v: v[-12:])[:1]  # the oldest epoch seen
            else:
                pool = [v for k, vs in seen.items() if k != key and k.endswith(tail) for v in vs]
            value = _read(store, key)
            if pool:
                store.set(key, rng.choice(pool))
            match = re.match(r"^(.*pdkv/[^/]+/[^/]+)/(\d+)/(.*)$", key)
            if (
                match and value is not None
            ):  # the next epoch's key, written ahead with this one's value
                ahead = f"{match[1]}/{int(match[2]) + 1}/{match[3]}"
                created.add(ahead)
                store.set(ahead, value)
    return acts


async def one_request(
    stub, name: str, prompt: list[int], output_len: int, timeout_s: float
) -> dict:
    request = generate_request(
        prompt, request_id=name, max_tokens=output_len, temperature=0.0, ignore_eos=True
    )
    start, tokens, error = time.perf_counter(), 0, None
    try:
        async for chunk in stub.Generate(request, timeout=timeout_s):
            tokens += len(chunk.token_ids)
    except grpc.aio.AioRpcError as e:
        error = f"{e.code().name}: {e.details()}"
    if error is None and tokens != output_len:
        error = f"{tokens} tokens of {output_len}"
    return {"name": name, "latency_s": time.perf_counter() - start, "error": error}


async def run_phases(server: ServerThread, args, attacker: Attacker) -> dict[str, list[dict]]:
    rng = random.Random(args.seed)
    results: dict[str, list[dict]] = {}
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # Warm-up: the pair's group is built and the workers' first steps are done before anything is timed.
        await asyncio.gather(
            *(one_request(stub, f"warm{i}", [0, 5, 6, 7], 4, args.timeout) for i in range(2))
        )
        for phase in args.phases:
            attacker.set(phase)
            tasks, start, i = [], time.perf_counter(), 0
            while time.perf_counter() - start < args.phase_s:
                prompt = [0, *(rng.randrange(3, 1000) for _ in range(args.input_len - 1))]
                request = one_request(stub, f"{phase}{i}", prompt, args.output_len, args.timeout)
                tasks.append(asyncio.create_task(request))
                i += 1
                await asyncio.sleep(args.every_s)
            attacker.set("baseline")
            results[phase] = await asyncio.gather(*tasks)
            print(
                f"{phase}: done ({attacker.acts[PHASES.index(phase)]} keys tampered with)",
                flush=True,
            )
    results["_acts"] = {phase: attacker.acts[i] for i, phase in enumerate(PHASES)}
    return results


def summarize(results: dict[str, list[dict]]) -> dict:
    base = sorted(r["latency_s"] for r in results["baseline"] if r["error"] is None)
    normal = statistics.median(base) if base else float("nan")
    summary = {"normal_latency_s": normal, "phases": {}}
    for phase, rs in results.items():
        if phase.startswith("_"):
            continue
        ok = [r["latency_s"] for r in rs if r["error"] is None]
        delays = [lat - normal for lat in ok]
        summary["phases"][phase] = {
            "requests": len(rs),
            "failed": sum(r["error"] is not None for r in rs),
            "first_error": next((r["error"] for r in rs if r["error"]), None),
            "latency_p50_s": statistics.median(ok) if ok else None,
            "latency_max_s": max(ok) if ok else None,
            "delay_max_s": max(delays) if delays else None,
            "delayed_over_2s": sum(d > DELAY_LIMIT_S for d in delays),
            "tampering_acts": results["_acts"].get(phase, 0),
        }
    return summary


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="tiny", help="checkpoint directory, or tiny")
    p.add_argument("--phase-s", type=float, default=6.0, help="length of each phase, s")
    p.add_argument(
        "--period-ms", type=float, default=20.0, help="between the attacker's rounds, ms"
    )
    p.add_argument("--every-s", type=float, default=0.5, help="between request starts, s")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--timeout", type=float, default=200.0, help="deadline per request, s")
    p.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated, of {','.join(PHASES)}"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.phases = args.phases.split(",")
    if unknown := set(args.phases) - set(PHASES):
        p.error(f"--phases: unknown {sorted(unknown)}; expected some of {','.join(PHASES)}")
    if "baseline" not in args.phases:
        args.phases.insert(0, "baseline")
    if (
        args.phase_s <= 0
        or args.period_ms <= 0
        or args.every_s <= 0
        or args.output_len < 1
        or args.input_len < 1
    ):
        p.error("--phase-s, --period-ms, --every-s, --input-len and --output-len must be positive")

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    port = free_port()
    attacker = Attacker(
        port, args.period_ms / 1e3
    )  # before Ray: forked while this process has no threads
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    config = build_config(
        None,
        {
            "model": {"path": args.model, "dtype": "fp32"},
            "cluster": {
                "num_prefill": 1,
                "num_decode": 1,
                "gpus_per_worker": 0,
                "cpus_per_worker": 0.25,
            },
            "router": {"port": 0, "http_port": None, "admission_timeout_s": args.timeout},
            "kvtransfer": {"store_port": port},
        },
    )
    print(
        f"serving {args.model}: 1 prefill + 1 decode worker on the CPU; KV store on 127.0.0.1:{port}"
    )
    try:
        with ServerThread(config) as server:
            results = asyncio.run(run_phases(server, args, attacker))
    finally:
        attacker.close()
        ray.shutdown()
    summary = summarize(results)
    summary["settings"] = {
        k: getattr(args, k)
        for k in ("model", "phase_s", "period_ms", "every_s", "input_len", "output_len")
    }
    print(json.dumps(summary, indent=2))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "kv_tamper.json").write_text(
            json.dumps(summary, indent=2) + "\n"
        )
    bad = any(s["failed"] or s["delayed_over_2s"] for s in summary["phases"].values())
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
