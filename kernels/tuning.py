"""Tuned launch configurations, per (op, shape class, device): the one place launchers look them up.

Each op registers a table mapping a shape-class key to a config dict (BLOCK_* sizes, num_warps, num_stages, ...).
`lookup(op, key, device)` returns the entry for the device's architecture family when one exists, else the op's
default. Keys are strings built by the op's launcher from the problem shape (e.g. "heads=16,dk=576").
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# op -> arch ("sm90", "sm100", "any") -> shape-class key ("default" always present) -> config
_TABLES: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}


def register(op: str, arch: str, table: dict[str, dict[str, Any]]) -> None:
    _TABLES.setdefault(op, {})[arch] = table


@functools.cache
def device_arch(device_index: int | None) -> str:
    if device_index is None or not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm{major}{minor}"


def lookup(op: str, key: str, device: torch.device) -> dict[str, Any]:
    """The tuned config for `op` at shape class `key` on `device`, falling back to the op's defaults."""
    arch = device_arch(device.index if device.type == "cuda" else None)
    tables = _TABLES.get(op, {})
    for candidate in (arch, "any"):
        table = tables.get(candidate, {})
        if key in table:
            return table[key]
    for candidate in (arch, "any"):
        table = tables.get(candidate, {})
        if "default" in table:
            return table["default"]
    raise KeyError(f"no tuning entry for op {op!r} (key {key!r}, arch {arch})")


# --- prefill-side kernels (mla_prefill, sampling, moe_route) -----------------------------------
# "cpu" entries are for the Triton interpreter (tests): small tiles keep it fast.
register(
    "mla_prefill",
    "cpu",
    {"default": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}},
)
register(
    "mla_prefill",
    "any",
    # H200 sweeps (2026-11-21, triton 3.6), 8 x 4096 causal h128, BM/BN/warps/stages -> ms:
    # 128/128/8/2 12.57 and 12.74, 128/64/8/3 13.05 and 13.14, 64/64/4/2 13.64, 128/64/8/2 15.05,
    # 64/32/4/2 15.43, 64/64/4/3 17.31, 64/128/4/2 18.56 (benchmarks/RESULTS.md)
    # fp32 inputs (IEEE dots, tests only): 128/128/8/2 needs 320 KiB of shared memory on triton 3.6
    {
        "default": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
        "dtype=float32": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    },
)
register(
    "sampling",
    "cpu",
    {"default": {"BLOCK": 256, "THRESHOLD_BLOCK": 256, "programs_per_sm": 2, "num_warps": 4}},
)
register(
    "sampling",
    "any",
    {"default": {"BLOCK": 2048, "THRESHOLD_BLOCK": 2048, "programs_per_sm": 4, "num_warps": 8}},
)
register("moe_route", "cpu", {"default": {"BLOCK_T": 8, "num_warps": 4}})
register(
    "moe_route",
    "any",
    {"default": {"BLOCK_T": 16, "num_warps": 4}, "experts=64": {"BLOCK_T": 32, "num_warps": 4}},
)
