"""Shared helpers for the kernel benchmarks: timing with CUDA events (median), ceilings, result rows, the table.

Ceilings are the ones measured on H200 in ../shared/DESIGN.md (2026-11-21, torch 2.11, triton 3.6)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

HBM_BYTES_PER_S = 4.27e12
BF16_FLOPS = 797e12
FP8_FLOPS = 1441e12


@dataclasses.dataclass
class Row:
    op: str
    shape: str
    impl: str
    ms: float
    gbps: float | None = None
    tflops: float | None = None
    ceiling_frac: float | None = None
    """Fraction of the relevant ceiling (HBM for memory-bound rows, the matrix rate for compute-bound rows)."""
    peer: str = ""
    peer_ms: float | None = None

    def cells(self) -> list[str]:
        def f(x, fmt):
            return "" if x is None else format(x, fmt)

        speedup = "" if self.peer_ms is None else f"{self.peer_ms / self.ms:.2f}x"
        return [
            self.op, self.shape, self.impl, f(self.ms, ".4f"), f(self.gbps, ".0f"), f(self.tflops, ".0f"),
            "" if self.ceiling_frac is None else f"{100 * self.ceiling_frac:.0f}%",
            self.peer, f(self.peer_ms, ".4f"), speedup,
        ]  # fmt: skip


HEADER = [
    "op",
    "shape",
    "impl",
    "ms",
    "GB/s",
    "TFLOP/s",
    "of ceiling",
    "peer",
    "peer ms",
    "speedup",
]


_FLUSH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def flush_l2() -> None:
    """Reads 256 MiB, so that no input of the next run is still in L2.

    The flush only reads: a flush that writes (zeroing the buffer) leaves L2 full of dirty lines,
    which the timed kernel then writes back to HBM while it reads its own inputs. On an H200 that
    cost 8-10 us per call, 5-20% of a 50-120 MB memory-bound kernel, against weights rotated through
    copies that no longer fit in L2.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    if device not in _FLUSH:
        _FLUSH[device] = (
            torch.zeros(64 << 20, dtype=torch.float32, device=device),
            torch.empty((), dtype=torch.float32, device=device),
        )
    buffer, sink = _FLUSH[device]
    torch.sum(buffer, dim=0, out=sink)


# GPU cycles of the spin between the flush and the timed run (about 100 us at 1.98 GHz).
_HOST_COVER_CYCLES = 200_000
_SPIN_CYCLES_PER_S = 2.0e9  # the spin counts SM clock cycles; the H200's boost clock is 1.98 GHz


def median_ms(
    run: Callable[[], object], before: Callable[[], object], warmup: int, iters: int
) -> float:
    """Median milliseconds of run() over `iters` runs timed by CUDA events, each after before() (not
    timed), following `warmup` untimed rounds."""
    for _ in range(warmup):
        before()
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _flush_and_cover(cycles: int = _HOST_COVER_CYCLES) -> None:
    flush_l2()
    torch.cuda._sleep(cycles)


def _host_launch_s(fn: Callable[[], object]) -> float:
    """Host seconds to enqueue one fn(), measured behind a long spin so that nothing waits on it."""
    torch.cuda._sleep(50 * _HOST_COVER_CYCLES)
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed


def time_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 50) -> float:
    """Median milliseconds of fn() over `iters` runs, each timed by CUDA events, after `warmup` runs.

    L2 is flushed (`flush_l2`) before every run so no input stays in L2 between runs. A spin
    kernel then keeps the GPU busy while the host enqueues fn's launches, so the time is the GPU's
    (kernels and the gaps between them), not the host's launch cost; before that spin, a launcher
    slower than the flush had the GPU's idle wait counted, by how much depending on the machine.
    The spin lasts about 100 us, or twice fn's host launch time where that is longer (fused_moe's
    dozen launches take 0.5-0.8 ms of host time, longer than the flush, so the GPU sat idle inside
    the timed window)."""
    for _ in range(warmup):
        _flush_and_cover()
        fn()
    host_s = min(_host_launch_s(fn) for _ in range(3))
    cycles = max(_HOST_COVER_CYCLES, int(2 * host_s * _SPIN_CYCLES_PER_S))
    return median_ms(fn, lambda: _flush_and_cover(cycles), 0, iters)


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn captured once in a CUDA graph (after a run on the current stream and one on a side
    stream, which compile and allocate outside the capture)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 50) -> float:
    """As `time_ms`, for fn captured once in a CUDA graph and replayed: how a decode step runs its kernels
    (no host launch cost between them)."""
    return time_ms(capture_graph(fn).replay, warmup, iters)


def print_table(rows: list[Row]) -> str:
    cells = [HEADER] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    lines = [
        "| " + " | ".join(c[i].ljust(widths[i]) for i in range(len(HEADER))) + " |" for c in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    text = "\n".join(lines)
    print(text, flush=True)
    return text
