"""Time to recover from KV transfer faults, per scenario (issue 46 item 5).

Runs the scenarios of tests/workers/test_transfer_faults.py on one backend through pytest (which supplies the
model and the reference outputs) and prints a table of the times each printed: when the fault's requests failed
or the survivor freed its pages, and when the pair first served a new request.

    python benchmarks/transfer_faults.py --backend gloo   # CPU
    python benchmarks/transfer_faults.py --backend nccl   # two CUDA GPUs
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(
    r"\[(\w+)\] ([^:]+): (?:\w+ )*?(?:failed|freed) in ([\d.]+) s, recovered in ([\d.]+) s$"
)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit for the whole run")
    args = parser.parse_args()
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "subprocess or multi_gpu",
        "-k", args.backend, "tests/workers/test_transfer_faults.py",
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        print(f"the scenarios did not finish within {args.timeout_s:.0f} s", file=sys.stderr)
        return 1
    rows = [m.groups() for m in map(LINE.search, proc.stdout.splitlines()) if m]
    print(f"{'backend':8} {'scenario':28} {'fault handled s':>16} {'recovered s':>12}")
    for backend, scenario, fault_s, recovered_s in rows:
        print(f"{backend:8} {scenario:28} {float(fault_s):16.2f} {float(recovered_s):12.2f}")
    if proc.returncode != 0 or not rows:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
