"""One launch of the Triton mla_prefill kernel at 8 x 4096 causal, 128 heads, bf16 (after a warm-
up), for `ncu -k regex:_mla_prefill_kernel -c 1` to profile."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mla_prefill import HEAD_QK, _varlen  # noqa: E402

from pdserve.kernels.mla_prefill import triton as tri  # noqa: E402

if __name__ == "__main__":
    q, k, v, cu_q, cu_k = _varlen([4096] * 8, [4096] * 8, 128)
    tri.mla_prefill(q, k, v, cu_q, cu_k, HEAD_QK**-0.5, True)
    torch.cuda.synchronize()
