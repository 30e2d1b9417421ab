"""Launch-config sweep for mla_decode on one GPU:  python benchmarks/tune_mla_decode.py [--json F]

For each DeepSeek-V3 shape below, times every candidate config (layout, BLOCK_M/N, warps, stages,
TMA, split count) with the benchmark's inputs, checks its output against the torch reference
(rel err <= 2e-2, else FAIL), and prints one table per shape, fastest first. The winners go into
the tuning table in kernels/mla_decode/triton.py by hand; this script only measures."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import time_ms  # noqa: E402
from bench_mla_decode import LORA, SCALE, make_inputs, make_row  # noqa: E402

from pdserve.kernels.mla_decode import ref  # noqa: E402
from pdserve.kernels.mla_decode import triton as tri  # noqa: E402


def cfg(layout, bm, bn, warps, stages, tma, splits):
    c = {"LAYOUT": layout, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
         "USE_TMA": tma}  # fmt: skip
    return c, splits


KV16 = [
    cfg("kv_major", 16, 64, 4, 2, True, 1), cfg("kv_major", 16, 64, 4, 2, True, 2),
    cfg("kv_major", 16, 64, 4, 3, True, 1), cfg("kv_major", 16, 64, 4, 2, False, 1),
    cfg("kv_major", 16, 64, 8, 2, True, 1), cfg("kv_major", 16, 32, 4, 3, False, 2),
    cfg("heads_major", 16, 32, 4, 3, False, 2),
]  # fmt: skip
KV128 = [
    cfg("heads_major", 64, 64, 8, 2, True, 1), cfg("heads_major", 64, 64, 8, 2, False, 1),
    cfg("heads_major", 64, 64, 8, 2, True, 2), cfg("heads_major", 64, 32, 8, 2, True, 1),
    cfg("heads_major", 64, 32, 8, 3, True, 1), cfg("kv_major", 64, 64, 8, 2, True, 1),
]  # fmt: skip
FP8_16 = [
    cfg("kv_major", 16, 64, 8, 2, True, 1), cfg("kv_major", 16, 64, 8, 2, True, 2),
    cfg("kv_major", 16, 64, 4, 2, True, 2), cfg("heads_major", 16, 64, 8, 2, True, 2),
    cfg("heads_major", 16, 32, 4, 2, False, 2), cfg("kv_major", 16, 32, 8, 2, False, 2),
]  # fmt: skip
FP8_128 = [
    cfg("heads_major", 64, 64, 8, 2, True, 1), cfg("heads_major", 64, 32, 8, 2, True, 1),
    cfg("kv_major", 16, 64, 8, 2, True, 1),
]  # fmt: skip
MTP16 = [
    cfg("heads_major", 64, 64, 8, 2, True, 1), cfg("kv_major", 64, 64, 8, 2, True, 1),
    cfg("kv_major", 32, 64, 8, 2, True, 1), cfg("kv_major", 16, 64, 4, 2, True, 1),
]  # fmt: skip

# More programs in flight per SM at 16 heads: 32-position tiles (36 KB a stage with TMA) leave room
# for two or three programs per SM, each with its own loads outstanding.
KV16_SMALL_TILES = [
    KV16[0],
    cfg("kv_major", 16, 32, 4, 2, True, 1), cfg("kv_major", 16, 32, 4, 2, True, 2),
    cfg("kv_major", 16, 32, 4, 2, True, 3), cfg("kv_major", 16, 32, 4, 3, True, 2),
    cfg("kv_major", 16, 32, 4, 4, True, 1), cfg("kv_major", 16, 32, 4, 3, True, 3),
    cfg("kv_major", 16, 64, 4, 2, True, 3),
]  # fmt: skip

SWEEPS = [
    # (batch, heads, queries, cache length, fp8, pages shuffled), candidates
    ((128, 16, 1, 4096, False, True), KV16),
    ((128, 16, 1, 8192, False, True), [KV16[0], KV16[1], KV16[3]]),
    ((128, 16, 1, 8192, False, False), [KV16[0]]),
    ((128, 128, 1, 4096, False, True), KV128),
    ((128, 128, 1, 8192, False, False), [KV128[0]]),
    ((128, 16, 1, 4096, True, True), FP8_16),
    ((128, 128, 1, 4096, True, True), FP8_128),
    ((64, 16, 4, 4096, False, True), MTP16),
    ((128, 16, 1, 4096, False, True), KV16_SMALL_TILES),
    ((128, 16, 1, 8192, False, True), KV16_SMALL_TILES),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None, help="write all measurements here")
    parser.add_argument("--only", type=int, default=None, help="run one sweep (index)")
    args = parser.parse_args()
    results = []
    for index, ((batch, heads, num_q, seq_len, fp8, shuffle), candidates) in enumerate(SWEEPS):
        if args.only is not None and index != args.only:
            continue
        q, cache, page_table, seq_lens = make_inputs(
            batch, heads, num_q, seq_len, 64, fp8, shuffle=shuffle
        )
        expected, _ = ref.mla_decode(q, cache, page_table, seq_lens, SCALE, LORA)
        shape = (f"B={batch} H={heads} Q={num_q} L={seq_len} {'fp8' if fp8 else 'bf16'} "
                 f"{'shuffled' if shuffle else 'contiguous'} pages")  # fmt: skip
        lines = []
        for config, splits in candidates:
            label = (f"{config['LAYOUT']} m{config['BLOCK_M']} n{config['BLOCK_N']} "
                     f"w{config['num_warps']} s{config['num_stages']}"
                     f"{' tma' if config['USE_TMA'] else ''} x{splits}")  # fmt: skip

            def call(config=config, splits=splits, inputs=(q, cache, page_table, seq_lens)):
                return tri.mla_decode_launch(*inputs, SCALE, LORA, splits, config)

            try:
                out, _ = call()
                err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
                ms = time_ms(call, warmup=3, iters=20)
            except Exception as exc:  # a config that does not compile or launch is a result
                lines.append((float("inf"), f"  {label:<44} ERROR {type(exc).__name__}: "
                                            f"{str(exc).splitlines()[0][:80]}"))  # fmt: skip
                continue
            row = make_row(shape, label, ms, batch, heads, num_q, seq_len, fp8)
            ok = "ok" if err <= 2e-2 else "FAIL"
            lines.append((ms, f"  {label:<44} {ms:8.4f} ms {row.gbps:6.0f} GB/s "
                              f"{row.tflops:5.0f} TF/s {100 * row.ceiling_frac:4.0f}% "
                              f"err {err:.1e} {ok}"))  # fmt: skip
            results.append(
                {
                    "shape": shape,
                    "config": config,
                    "splits": splits,
                    "ms": ms,
                    "gbps": row.gbps,
                    "tflops": row.tflops,
                    "err": err,
                }
            )
        print(shape, flush=True)
        for _, line in sorted(lines):
            print(line, flush=True)
        del q, cache, expected
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
