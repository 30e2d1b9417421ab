"""What the tests that serve share: servers started on free ports with fractional-CPU workers and small KV caches,
and the helpers that send requests and read status and metrics (`from serving import start_server`). The session's
fixtures (Ray, the tiny checkpoint, offline references, the shared server) are in tests/conftest.py."""

from __future__ import annotations

import os
import time
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cli.client import Client, generate_request
from pdserve.cluster.config import build_config
from pdserve.engine.offline import OfflineGenerator
from pdserve.engine.sampling_params import SamplingParams, TokenLogprobs
from pdserve.frontend.server import ServerThread, free_port
from pdserve.v1 import generation_pb2

SHARED_PROMPT_BYTES = 16 << 10
"""The shared server's router.max_prompt_bytes (small, so that a test can pass it)."""


def serve_config(model_dir, **sections):
    """A config for tests: free ports, fp32, small KV caches, quarter-CPU workers, quiet logs."""
    values = {
        "model": {"path": str(model_dir), "dtype": "fp32"},
        "cluster": {"cpus_per_worker": 0.25, "placement_timeout_s": 60.0, "load_timeout_s": 120.0},
        "router": {
            "port": 0,
            "http_port": None,
            "stats_interval_s": 0.0,
            "admission_timeout_s": 20.0,
            # a loaded 2-core CI machine can hold a healthy worker's answer for seconds: only test_survive, which
            # loses workers on purpose, runs the default
            "heartbeat_timeout_s": 15.0,
        },
        "prefill": {"num_pages": 512, "max_prefill_chunk": 128, "max_num_batched_tokens": 512},
        "decode": {"num_pages": 512, "max_prefill_chunk": 128, "max_num_batched_tokens": 512},
        "kvtransfer": {"store_port": free_port(), "connect_timeout_s": 20.0},
    }
    for name, fields in sections.items():
        values.setdefault(name, {}).update(fields)
    return build_config(None, values)


def start_server(model_dir, **sections) -> ServerThread:
    """Use as a context manager (Ray must be up: depend on the `ray_cluster` fixture)."""
    return ServerThread(serve_config(model_dir, **sections))


def engine_scoring(
    reference_model, context: list[int], continuation: list[int]
) -> list[TokenLogprobs]:
    """The engine's own log-probabilities of `continuation`'s tokens after `context` (its prompt log-probabilities,
    with each token's rank), as an evaluation harness's multiple-choice score sums them."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    ids = [*context, *continuation]
    got = OfflineGenerator(reference_model, 4, prefill_chunk=7).generate(ids, params)
    return got.prompt_logprobs[len(context) - 1 :]


def engine_score(reference_model, context: list[int], continuation: list[int]) -> float:
    """The engine's own log-likelihood of `continuation` after `context`."""
    return sum(lp.logprob for lp in engine_scoring(reference_model, context, continuation))


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(interval_s)


def workload(n: int, seed: int, max_len: int = 200) -> list[tuple[list[int], int]]:
    """n (prompt ids, max_tokens) pairs of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 1 + int(torch.randint(0, max_len, (1,), generator=g))
        prompt = [0, *torch.randint(3, 1000, (length - 1,), generator=g).tolist()]
        out.append((prompt, 4 + (7 * i) % 29))
    return out


def greedy(prompt, max_tokens: int, **kw) -> generation_pb2.GenerateRequest:
    return generate_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def collect(
    client: Client, request, timeout_s: float = 120
) -> list[generation_pb2.GenerateResponse]:
    return list(client.generate(request, timeout_s=timeout_s))


def pages_in_use(client: Client) -> dict[str, int]:
    status = client.status()
    return {w.worker_id: w.kv_pages_used for pool in status.pools for w in pool.workers}


def all_pages_free(client: Client) -> bool:
    status = client.status()
    return status.num_requests == 0 and not any(pages_in_use(client).values())


def scrape(url: str) -> dict:
    """The metric families at `url` (Prometheus' text format), by family name."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["content-type"].startswith("text/plain")
        text = reply.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def listening() -> dict[str, tuple[str, int]]:
    """Socket inode -> (local address in /proc's hex, port) of every listening TCP socket on this host."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    host, port = fields[1].split(":")
                    out[fields[9]] = (host, int(port, 16))
    return out


def is_loopback_hex(host: str) -> bool:
    """Whether a local address as /proc/net/tcp{,6} writes it is loopback (127/8, ::1, ::ffff:127/104)."""
    if len(host) == 8:
        return host.endswith("7F")  # little-endian: 127.x.x.x
    return host == "00000000000000000000000001000000" or (
        host.startswith("0000000000000000FFFF0000") and host.endswith("7F")
    )


def sockets_of(pid: int) -> set[str]:
    """The socket inodes `pid` holds (none once it is gone)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # exited
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes
