"""benchmarks/serving.py's steady-state window: only requests sent in the window are measured, output tokens/s
counts the tokens that arrived in it, and a load whose completions fall short of the offered rate or whose TTFT
climbs is reported as not held."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# for its own imports (_sse); appended: benchmarks/kernels.py must not shadow HF `kernels`, which transformers imports
sys.path.append(str(BENCHMARKS))
# by path, under its own name: `serving` is tests/serving.py to the serving tests
_spec = importlib.util.spec_from_file_location("serving_benchmark", BENCHMARKS / "serving.py")
serving = sys.modules["serving_benchmark"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serving)


def args(rate: float | None) -> argparse.Namespace:
    return argparse.Namespace(
        protocol="grpc", addr="-", base_url="-", request_rate=rate, concurrency=4, input_len=8, output_len=4,
        goodput={}, check_offline=False, num_gpus=2, warmup_s=10.0,
    )  # fmt: skip


def request(sent: float, ttft: float, gap: float = 0.1, tokens: int = 4) -> serving.Result:
    r = serving.Result([0], num_tokens=tokens)
    return r.timed(sent, [sent + ttft + i * gap for i in range(tokens)])


def test_the_window_measures_its_own_requests_and_tokens():
    # one request a second from t=0 to 39; the window is [10, 30): 20 requests, each 4 tokens 0.1 s apart
    results = [request(float(t), 0.2) for t in range(40)]
    s = serving.summarize_window(args(1.0), results, 10.0, 30.0, 0)
    assert s["steady_state"] and s["num_requests"] == 20 and s["arrival_rate"] == 1.0
    # tokens in [10, 30): those of the requests sent at 10..29 (request 9's last came at 9.5)
    assert abs(s["output_tokens_per_s"] - 80 / 20) < 1e-9
    assert s["output_tokens_per_s_per_gpu"] == s["output_tokens_per_s"] / 2
    assert s["load_held"]


def test_a_load_not_kept_up_with_is_not_held():
    results = [request(float(t), 0.2) for t in range(40)]
    assert not serving.summarize_window(args(2.0), results, 10.0, 30.0, 0)[
        "load_held"
    ]  # offered 2/s
    climbing = [request(float(t), 0.2 + 0.1 * t) for t in range(40)]
    s = serving.summarize_window(args(None), climbing, 10.0, 30.0, 0)
    assert s["ttft_ms_p50_second_half"] > 1.5 * s["ttft_ms_p50_first_half"] and not s["load_held"]


def test_an_error_in_the_window_means_not_held():
    results = [request(float(t), 0.2) for t in range(40)]
    results[15].error = "UNAVAILABLE: gone"
    s = serving.summarize_window(args(None), results, 10.0, 30.0, 0)
    assert s["errors"] == 1 and not s["load_held"]
