"""Test-wide settings: GPU markers skip where no CUDA device is present; on CPU-only machines Triton kernels run in
the interpreter (TRITON_INTERPRET=1 must be set before any kernel module is imported, hence here)."""

from __future__ import annotations

import os

import pytest

try:
    import torch

    _CUDA_DEVICES = torch.cuda.device_count()
except ImportError:  # pragma: no cover
    _CUDA_DEVICES = 0

if _CUDA_DEVICES == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "multi_gpu" in item.keywords and _CUDA_DEVICES < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 CUDA GPUs"))
        elif "gpu" in item.keywords and _CUDA_DEVICES < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
