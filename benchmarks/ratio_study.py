"""The prefill:decode ratio study: which split of a fixed number of GPUs into prefill and decode workers serves the
most requests per second within an SLO, read from the sweeps `benchmarks/sweep_gpu.sh` writes (each point's
requests kept with `benchmarks/serving.py --keep-latencies`, so that any SLO can be read from one run).

    python benchmarks/ratio_study.py DIR [--slo ttft:2000,tpot:30 --slo ttft:2000,tpot:20] [--min-share 0.9]

DIR holds one sweep-<layout>.json per layout of the same ISL / OSL (sweep-1p1d.json, sweep-0p2d.json, ...). Per
SLO and layout, over the swept rates: the highest offered rate at which at least --min-share of the measured
requests met every bound of the SLO (DistServe's goodput: TTFT and TPOT at once) and the load was held (the
steady-state check of benchmarks/serving.py: completions kept up with the offered rate, TTFT did not climb, no
errors); its goodput (requests/s within the SLO) in all and per GPU. The layout with the most goodput per GPU wins
that SLO. Prints a markdown table and writes DIR/ratio.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DEFAULT_SLOS = ("ttft:2000,tpot:30", "ttft:2000,tpot:20")
BOUNDS = ("ttft", "tpot")


def parse_slo(text: str) -> dict[str, float]:
    """'ttft:2000,tpot:30' -> {'ttft': 2000.0, 'tpot': 30.0} (ms); raises ValueError naming what is wrong."""
    out = {}
    for part in text.split(","):
        key, _, value = part.partition(":")
        if key not in BOUNDS:
            raise ValueError(f"{text!r}: {key!r} is not one of {', '.join(BOUNDS)}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"{text!r}: {value!r} is not a number of ms") from None
        if out[key] <= 0:
            raise ValueError(f"{text!r}: {key} must be > 0 ms")
    return out


def met(latencies_ms: list, slo: dict[str, float]) -> int:
    """Requests whose TTFT and TPOT (null TPOT: a one-token answer, no bound to meet) are within `slo`."""
    good = 0
    for ttft, tpot in latencies_ms:
        ok = ttft <= slo.get("ttft", float("inf"))
        ok = ok and (tpot is None or tpot <= slo.get("tpot", float("inf")))
        good += ok
    return good


def best_point(points: list[dict], slo: dict[str, float], min_share: float) -> dict | None:
    """The highest-rate point that held its load with at least `min_share` of its requests within `slo`, with
    its share and goodput; None if no point did."""
    best = None
    for point in points:
        if "latencies_ms" not in point:
            raise ValueError(
                "a point without latencies_ms: sweep with benchmarks/serving.py --keep-latencies"
            )
        requests = point["num_requests"]
        good = met(point["latencies_ms"], slo)
        share = good / requests if requests else 0.0
        if share >= min_share and point.get("load_held"):
            rate = point["request_rate"]
            if best is None or rate > best["request_rate"]:
                window = point.get("window_s") or point["wall_s"]
                best = {"request_rate": rate, "share": share, "goodput": good / window}
    return best


def study(folder: Path, slos: list[str], min_share: float) -> tuple[list[str], list[dict]]:
    sweeps = sorted(folder.glob("sweep-*.json"))
    if not sweeps:
        raise ValueError(f"{folder}: no sweep-<layout>.json files")
    rows, lines = [], []
    loaded = {p: json.loads(p.read_text()) for p in sweeps}
    first = next(iter(loaded.values()))
    lines.append(
        f"{first.get('title', '')}; within the SLO: at least {min_share:.0%} of requests, load held"
    )
    lines.append(
        "| SLO (ms) | layout | GPUs | highest rate held | within SLO | goodput req/s | per GPU |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for text in slos:
        slo = parse_slo(text)
        results = []
        for path, sweep in loaded.items():
            layout = re.sub(r"^sweep-", "", path.stem)
            try:
                best = best_point(sweep["points"], slo, min_share)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
            gpus = sweep["num_gpus"]
            per_gpu = None if best is None else best["goodput"] / gpus
            results.append((layout, gpus, best, per_gpu))
            rows.append({"slo": text, "layout": layout, "num_gpus": gpus, "best": best})
        winner = max((r for r in results if r[3] is not None), key=lambda r: r[3], default=None)
        for layout, gpus, best, per_gpu in results:
            mark = " (best)" if winner is not None and layout == winner[0] else ""
            if best is None:
                lines.append(f"| {text} | {layout} | {gpus} | none held | | | |")
                continue
            lines.append(
                f"| {text} | {layout}{mark} | {gpus} | {best['request_rate']:g} req/s | "
                f"{best['share']:.0%} | {best['goodput']:.2f} | {per_gpu:.2f} |"
            )
    return lines, rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("folder", type=Path, help="the sweeps' folder (sweep-<layout>.json)")
    p.add_argument(
        "--slo", action="append", default=None, metavar="ttft:MS,tpot:MS",
        help=f"an SLO, repeatable (default: {' and '.join(DEFAULT_SLOS)})",
    )  # fmt: skip
    p.add_argument(
        "--min-share", type=float, default=0.9,
        help="share of requests that must meet the SLO at a rate (default 0.9)",
    )  # fmt: skip
    args = p.parse_args()
    if not 0 < args.min_share <= 1:
        p.error(f"--min-share {args.min_share}: must be in (0, 1]")
    try:
        lines, rows = study(args.folder, args.slo or list(DEFAULT_SLOS), args.min_share)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"ratio_study: {e}", file=sys.stderr)
        sys.exit(2)
    print("\n".join(lines))
    (args.folder / "ratio.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
