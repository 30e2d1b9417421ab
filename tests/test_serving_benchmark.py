"""benchmarks/serving.py's steady-state window: only requests sent in the window are measured, output tokens/s
counts the tokens that arrived in it, and a load whose completions fall short of the offered rate or whose TTFT
climbs is reported as not held. benchmarks/ratio_study.py reads such sweeps' kept latencies at any SLO: per
layout the highest rate held within it, and the layout with the most goodput per GPU."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

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
        goodput={}, check_offline=False, num_gpus=2, warmup_s=10.0, keep_latencies=True,
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


_ratio_spec = importlib.util.spec_from_file_location("ratio_study", BENCHMARKS / "ratio_study.py")
ratio_study = importlib.util.module_from_spec(_ratio_spec)
_ratio_spec.loader.exec_module(ratio_study)


def sweep_point(rate: float, ttft: float, gap: float) -> dict:
    """A steady-state point at `rate` req/s (window [10, 30)), each request's first token after `ttft` s and
    the next every `gap` s."""
    results = [request(t / rate, ttft, gap) for t in range(int(40 * rate))]
    return serving.summarize_window(args(rate), results, 10.0, 30.0, 0)


def test_the_ratio_study_reads_each_layout_at_any_slo(tmp_path):
    import json

    layouts = {
        # 2 GPUs: TPOT 25 ms at 1 and 2 req/s; at 4 req/s TTFT over 2 s
        "1p1d": (2, [sweep_point(1, 0.3, 0.025), sweep_point(2, 0.3, 0.025), sweep_point(4, 2.5, 0.025)]),
        # 2 GPUs: TPOT 18 ms up to 4 req/s
        "0p2d": (2, [sweep_point(1, 0.2, 0.018), sweep_point(4, 0.4, 0.018)]),
    }  # fmt: skip
    for name, (gpus, points) in layouts.items():
        record = {"title": "test", "num_gpus": gpus, "points": points}
        (tmp_path / f"sweep-{name}.json").write_text(json.dumps(record))
    lines, rows = ratio_study.study(tmp_path, ["ttft:2000,tpot:30", "ttft:2000,tpot:20"], 0.9)
    best = {(r["slo"], r["layout"]): r["best"] for r in rows}
    assert best["ttft:2000,tpot:30", "1p1d"]["request_rate"] == 2
    assert best["ttft:2000,tpot:30", "0p2d"]["request_rate"] == 4
    assert best["ttft:2000,tpot:20", "1p1d"] is None  # TPOT 25 ms misses 20 ms at every rate
    assert best["ttft:2000,tpot:20", "0p2d"]["goodput"] == pytest.approx(4.0, rel=0.05)
    assert any("0p2d (best)" in line for line in lines)
    bare = {**layouts["0p2d"][1][0]}
    del bare["latencies_ms"]
    (tmp_path / "sweep-old.json").write_text(json.dumps({"num_gpus": 2, "points": [bare]}))
    with pytest.raises(ValueError, match="sweep-old.json: a point without latencies_ms"):
        ratio_study.study(tmp_path, ["ttft:2000"], 0.9)
    with pytest.raises(ValueError, match="'itl' is not one of ttft, tpot"):
        ratio_study.parse_slo("itl:5")
