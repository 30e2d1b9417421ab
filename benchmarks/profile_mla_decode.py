"""One mla_decode launch to profile under ncu:
    ncu --clock-control none -k regex:split -c 1 python benchmarks/profile_mla_decode.py B H Q L fp8

Warms up (compiles) first, then runs the benchmark's inputs once more, so `-c 1` after
`--launch-skip` of the warm-up launches catches a steady-state launch with the tuned config."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mla_decode import LORA, SCALE, make_inputs  # noqa: E402

from pdserve.kernels.mla_decode import triton as tri  # noqa: E402


def main() -> None:
    batch, heads, num_q, seq_len, fp8 = (int(a) for a in sys.argv[1:6])
    q, cache, page_table, seq_lens = make_inputs(batch, heads, num_q, seq_len, 64, bool(fp8))
    tri.mla_decode(q, cache, page_table, seq_lens, SCALE, LORA)  # compile; ncu skips this one
    torch.cuda.synchronize()
    tri.mla_decode(q, cache, page_table, seq_lens, SCALE, LORA)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
