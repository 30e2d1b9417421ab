"""The serving sweep's plot (`benchmarks/serving.py --sweep-*` and `--plot-from`): output tokens/s per GPU against
tokens/s per user, and goodput against the swept value; needs matplotlib (`pip install .[benchmarks]`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def plot_sweep(series: dict[str, list[dict]], swept: str, path: Path, title: str) -> bool:
    """Two panels, one line per series (e.g. disaggregated and aggregated): output tokens/s per GPU against
    tokens/s per user (each point labelled with its swept value), and goodput (or, without --goodput, completed
    requests/s) against the swept value. False (and a line on stderr) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the figures are in the JSON; a host without matplotlib still gets them
        print(
            f"no plot {path}: it needs matplotlib (pip install .[benchmarks]); the sweep's JSON is written",
            file=sys.stderr,
        )
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    first = next(iter(series.values()))
    key = "goodput_requests_per_s" if "goodput_requests_per_s" in first[0] else "requests_per_s"
    for label, points in series.items():
        xs = [p["tokens_per_s_per_user"] or 0.0 for p in points]
        ys = [p["output_tokens_per_s_per_gpu"] for p in points]
        left.plot(xs, ys, "o-", label=label or None)
        for x, y, p in zip(xs, ys, points, strict=True):
            left.annotate(
                f"{p[swept]:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8
            )
        swept_values = [p[swept] for p in points]
        right.plot(
            swept_values, [p[key] for p in points], "o-", label=label or key.replace("_", " ")
        )
    if swept == "request_rate":
        offered = sorted({p[swept] for points in series.values() for p in points})
        right.plot(offered, offered, ":", color="gray", label="offered (nominal rate)")
    left.set_xlabel("output tokens/s per user (1 / median TPOT)")
    left.set_ylabel("output tokens/s per GPU")
    left.set_title(f"throughput against interactivity (labels: {swept.replace('_', ' ')})")
    if len(series) > 1:
        left.legend()
    left.grid(alpha=0.3)
    right.set_xlabel(swept.replace("_", " "))
    right.set_ylabel("good requests/s" if key == "goodput_requests_per_s" else "requests/s")
    slo = first[0].get("goodput_slo")
    right.set_title(f"goodput ({slo})" if slo else "completed requests/s")
    right.legend()
    right.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def plot_files(p: argparse.ArgumentParser, items: list[str], prefix: Path) -> None:
    """--plot-from: one plot of sweeps already written (`FILE.json[=LABEL]` each)."""
    series, swept, titles = {}, None, []
    for item in items:
        file, _, label = item.partition("=")
        try:
            record = json.loads(Path(file).read_text())
        except (OSError, json.JSONDecodeError) as e:
            p.error(f"--plot-from {file}: {e}")
        if swept not in (None, record["swept"]):
            p.error(f"--plot-from: {file} sweeps {record['swept']}, the first file {swept}")
        swept = record["swept"]
        series[label or Path(file).stem] = record["points"]
        titles.append(record.get("title", ""))
    if plot_sweep(series, swept, prefix.with_suffix(".png"), titles[0]):
        print(f"wrote {prefix.with_suffix('.png')}")
