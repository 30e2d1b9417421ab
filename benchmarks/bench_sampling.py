"""Sampling over DeepSeek-V3's vocab (129280, fp32 logits) at batch 1-256: the Triton path against
the torch reference on the same GPU.

Batches: "mixed" cycles greedy / temperature / top-k / top-p / min-p / combined rows (top-k and
top-p rows take the sorted path); "no sort" has temperature and min-p rows only. Logits are randn *
4 (peaked like a trained model's, not flat). GB/s counts one read of the logits, the least any
sampler must move."""

from __future__ import annotations

import torch
from _bench import HBM_BYTES_PER_S, Row, time_ms

VOCAB = 129280
MIXED = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (1.3, 0, 0.9, 0.0),
         (1.0, 0, 1.0, 0.1), (0.8, 20, 0.8, 0.05)]  # fmt: skip
NO_SORT = [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.05)]


def _args(batch: int, kinds: list[tuple[float, int, float, float]]):
    dev = "cuda"
    logits = torch.randn(batch, VOCAB, device=dev) * 4
    rows = [kinds[i % len(kinds)] for i in range(batch)]
    temperature, top_k, top_p, min_p = (
        torch.tensor(c, device=dev) for c in zip(*rows, strict=True)
    )
    seeds = torch.randint(0, 2**62, (batch,), device=dev)
    steps = torch.randint(0, 4096, (batch,), device=dev)
    return logits, temperature.float(), top_k.int(), top_p.float(), min_p.float(), seeds, steps


def run(quick: bool) -> list[Row]:
    from pdserve.kernels.sampling import ref
    from pdserve.kernels.sampling import triton as tri

    batches = [1, 32, 256] if not quick else [1, 256]
    rows = []
    for kinds_name, kinds in (("mixed", MIXED), ("no sort", NO_SORT)):
        for batch in batches:
            args = _args(batch, kinds)
            ms = time_ms(lambda: tri.sample(*args))  # noqa: B023
            gbps = batch * VOCAB * 4 / ms / 1e6
            rows.append(Row("sample", f"b{batch} v{VOCAB} {kinds_name}", "triton", ms, gbps=gbps,
                            ceiling_frac=gbps * 1e9 / HBM_BYTES_PER_S, peer="torch ref",
                            peer_ms=time_ms(lambda: ref.sample(*args), iters=20)))  # noqa: B023  # fmt: skip
    return rows
