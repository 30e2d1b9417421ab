"""How the L2 flush before each timed run changes memory-bound timings.

`_bench.time_ms` zeroed a 256 MiB buffer before every run. That leaves L2 full of dirty lines, which
the timed kernel must write back to HBM while it reads its own inputs. This probe times the same
memory-bound calls three ways and prints them side by side:
  zero    - the zeroing flush (as `time_ms` did until this probe);
  read    - a flush that only reads 256 MiB (L2 left holding clean lines; `time_ms` now);
  rotate  - no flush: each run uses the next of enough weight copies that none is still in L2.

    python benchmarks/l2_flush_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fused_moe  # noqa: E402
import bench_mla_decode  # noqa: E402
import tune_moe_fp8  # noqa: E402
from _bench import HBM_BYTES_PER_S, capture_graph, median_ms  # noqa: E402

from pdserve.kernels import tuning  # noqa: E402
from pdserve.kernels.fp8_gemm import ref  # noqa: E402
from pdserve.kernels.fp8_gemm import triton as tri  # noqa: E402
from pdserve.kernels.fused_moe import triton as moe  # noqa: E402
from pdserve.kernels.mla_decode import triton as mla  # noqa: E402

FLUSH_BYTES = 256 << 20


def _cases():
    """(name, weight bytes, make(copy index) -> fn) for memory-bound calls."""
    cases = []
    mma = tuning.lookup("fp8_gemm", "m<=16", torch.device("cuda", 0))
    gemv = tuning.lookup("fp8_gemm", "m<=1", torch.device("cuda", 0))
    for name, m, k, n, cfg in (
        ("fp8_gemm o, MMA", 1, 16384, 7168, mma), ("fp8_gemm o, gemv", 1, 16384, 7168, gemv),
        ("fp8_gemm mlp_w1, MMA", 1, 7168, 18432, mma),
        ("fp8_gemm mlp_w1, gemv", 1, 7168, 18432, gemv), ("fp8_gemm o", 64, 16384, 7168, None),
    ):  # fmt: skip
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

        def make(_i, x=x, n=n, k=k, cfg=cfg):
            w, s = ref.quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
            if cfg is None:
                return lambda: tri.fp8_gemm(x, w, s)
            out = torch.empty((x.shape[0], n), device="cuda", dtype=x.dtype)
            return lambda: tri._launch_gemm(x, None, w, s, out, cfg)

        cases.append((f"{name} M={m}", n * k, make))

    def make_mla(_i):
        q, cache, page_table, seq_lens = bench_mla_decode.make_inputs(128, 16, 1, 4096, 64, False)
        return lambda: mla.mla_decode(q, cache, page_table, seq_lens, bench_mla_decode.SCALE, 512)

    cases.append(("mla_decode B=128 H=16 L=4096 bf16", 128 * 4096 * 576 * 2, make_mla))

    def make_moe(_i):
        x, weights, ids = tune_moe_fp8._moe_inputs(64)
        w13, w2 = tune_moe_fp8._MOE["w"]
        return lambda: moe.fused_moe(x, w13, w2, weights, ids)

    touched = 32 * 3 * bench_fused_moe.HIDDEN * bench_fused_moe.INTER * 2
    cases.append(("fused_moe bf16 T=64 (32 experts touched)", touched, make_moe))
    for mib in (128, 1024):

        def make_sum(_i, mib=mib):
            t = torch.randn(mib << 19, device="cuda", dtype=torch.bfloat16)
            out = torch.empty((), device="cuda", dtype=torch.float32)
            return lambda: torch.sum(t, dim=0, dtype=torch.float32, out=out)

        cases.append((f"torch.sum of {mib} MiB bf16", mib << 20, make_sum))
    return cases


def main() -> None:
    flush = torch.zeros(FLUSH_BYTES // 4, device="cuda", dtype=torch.float32)
    sink = torch.empty((), device="cuda", dtype=torch.float32)
    zero = flush.zero_
    read = lambda: torch.sum(flush, dim=0, out=sink)  # noqa: E731
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):  # about a second of GEMMs: clocks up before the first timing
        a @ a
    del a
    print(
        f"{torch.cuda.get_device_name()}, CUDA graphs, median of 40 | GB/s counts the bytes read once"
    )
    print("| call | zero flush | read flush | zero flush again | rotating copies, no flush |")
    print("|---|---|---|---|---|")
    for name, nbytes, make in _cases():
        copies = max(2, -(-3 * FLUSH_BYTES // nbytes))  # together well over L2
        fns = [make(i) for i in range(copies)]  # they hold the tensors the graphs read
        graphs = [capture_graph(fn) for fn in fns]
        cells = []
        for before in (zero, read, zero):
            ms = median_ms(graphs[0].replay, before, warmup=20, iters=40)
            cells.append(f"{ms * 1e3:.1f} us, {nbytes / ms / 1e6:.0f} GB/s")
        turn = iter(range(10**9))
        ms = median_ms(
            lambda g=graphs, t=turn, c=copies: g[next(t) % c].replay(), lambda: None, 20, 40
        )
        cells.append(f"{ms * 1e3:.1f} us, {nbytes / ms / 1e6:.0f} GB/s")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        del graphs, fns
        torch.cuda.empty_cache()
    print(f"(ceiling in DESIGN.md: {HBM_BYTES_PER_S / 1e9:.0f} GB/s)")


if __name__ == "__main__":
    main()
