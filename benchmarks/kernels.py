"""Kernel benchmarks on one GPU, in one command:  python benchmarks/kernels.py [--ops a,b] [--quick]

Each `bench_<op>.py` beside this file defines `run(quick: bool) -> list[Row]` over DeepSeek-V3's shapes and times
the Triton kernel next to its torch peer where one exists. Prints one table (median ms, GB/s or TFLOP/s, fraction
of the ceiling in ../shared/DESIGN.md, the peer's time) and writes it to $OUT/kernels.md when OUT is set."""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _bench import print_table  # noqa: E402


def main() -> None:
    ops = sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", default=",".join(ops), help=f"comma-separated subset of {ops}")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args()
    import torch

    rows = []
    for op in args.ops.split(","):
        module = importlib.import_module(f"bench_{op}")
        rows.extend(module.run(args.quick))
    # PDSERVE_COMMIT: the commit measured, where the checkout's own .git is stale or absent (the
    # device machine gets a copy of the working tree)
    commit = (
        os.environ.get("PDSERVE_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip()
    )
    title = (
        f"{torch.cuda.get_device_name()} | {datetime.date.today()} | torch {torch.__version__} | "
        f"commit {commit or 'unknown'}"
    )
    print(title)
    table = print_table(rows)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kernels.md").write_text(title + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
