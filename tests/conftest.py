"""Test-wide settings: GPU markers skip where no CUDA device is present; on CPU-only machines Triton kernels run in
the interpreter (TRITON_INTERPRET=1 must be set before any kernel module is imported, hence here).

`gpu_sweep` marks a case of a shape sweep that runs only where a CUDA device is present: under the interpreter
one smallest case per code path (dtype x kernel variant) runs, and the case marked names, in a comment, the one
that takes its code path on CPU."""

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

GPU_SWEEP_REASON = (
    "shape sweep: runs where CUDA is present; on CPU a smaller case takes its code path"
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "multi_gpu" in item.keywords and _CUDA_DEVICES < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 CUDA GPUs"))
        elif "gpu" in item.keywords and _CUDA_DEVICES < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif "gpu_sweep" in item.keywords and _CUDA_DEVICES < 1:
            item.add_marker(pytest.mark.skip(reason=GPU_SWEEP_REASON))


@pytest.fixture(scope="session")
def v2lite_dir(tmp_path_factory):
    """A v2-lite-shape bf16 checkpoint for GPU tests: $PDSERVE_V2LITE_DIR, or made on the GPU once a session."""
    from pathlib import Path

    from pdserve.model.random_checkpoint import make_checkpoint

    path = os.environ.get("PDSERVE_V2LITE_DIR")
    if path:
        return Path(path)
    out = tmp_path_factory.mktemp("ck") / "v2l"
    return make_checkpoint(out, "v2-lite-shape", dtype="bf16", device="cuda", progress=False)


# The serving fixtures (a session's local Ray, the tiny checkpoint, offline references), for every folder's tests.
from serving import (  # noqa: E402, F401
    model_dir,
    ray_cluster,
    reference,
    reference_logits,
    reference_model,
)
