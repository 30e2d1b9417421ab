"""How many runs of consecutive pages the decode worker's allocator hands a request as it is admitted, while the
pool fills and drains: a CPU simulation with the real `PageAllocator` (no model, no GPU).

    python benchmarks/page_runs.py [--pool-pages 40000,20000,12000] [--steps 20000] [--running 64]

A request whose pages are one run travels from its prefill worker in one message into place; one whose pages
are a few runs travels in one message per run, each into place; beyond that, D unpacks a packed copy
(kvtransfer). Each step: the running requests grow (one page every `page_size` generated tokens), finished
ones free their pages, and new ones are admitted while the pool has room (prompts of 16-8192 tokens, log-uniform;
16-2048 generated tokens). Prints, per pool size, the share of admissions whose pages are 1 run, at most 4 runs,
at most 8 runs, and the mean number of runs.
"""

from __future__ import annotations

import argparse
import math
import random

from pdserve.kvtransfer.pages import run_breaks
from pdserve.model.pages import PageAllocator, pages_needed

PAGE_SIZE = 16


def simulate(pool_pages: int, steps: int, running: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    alloc = PageAllocator(pool_pages)
    live: list[dict] = []
    runs: list[int] = []
    for _ in range(steps):
        for r in list(live):  # one decode step
            r["done"] += 1
            if r["done"] >= r["out"]:
                alloc.free(r["pages"])
                live.remove(r)
            elif (r["prompt"] + r["done"]) % PAGE_SIZE == 0:
                if not alloc.can_allocate(1):  # preempted: freed, as recompute would
                    alloc.free(r["pages"])
                    live.remove(r)
                    continue
                r["pages"] += alloc.allocate(1)
        while len(live) < running:
            prompt = int(math.exp(rng.uniform(math.log(16), math.log(8192))))
            need = pages_needed(prompt, PAGE_SIZE)
            if not alloc.can_allocate(need + 8):  # keep room for growth, as admission does
                break
            pages = alloc.allocate(need)
            runs.append(len(run_breaks(pages)) + 1)
            live.append({"prompt": prompt, "out": rng.randint(16, 2048), "done": 0, "pages": pages})
    n = len(runs)
    return {
        "admissions": n,
        "1 run": sum(r == 1 for r in runs) / n,
        "<= 4 runs": sum(r <= 4 for r in runs) / n,
        "<= 8 runs": sum(r <= 8 for r in runs) / n,
        "mean runs": sum(runs) / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pool-pages", default="40000,20000,12000", type=lambda s: [int(x) for x in s.split(",")]
    )
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| pool pages | admissions | 1 run | <= 4 runs | <= 8 runs | mean runs |")
    print("|---|---|---|---|---|---|")
    for pool in args.pool_pages:
        r = simulate(pool, args.steps, args.running, args.seed)
        print(
            f"| {pool} | {r['admissions']} | {r['1 run']:.0%} | {r['<= 4 runs']:.0%} | "
            f"{r['<= 8 runs']:.0%} | {r['mean runs']:.1f} |"
        )


if __name__ == "__main__":
    main()
