"""Tuned-config lookup: the device's architecture family picks the table, a bare "cuda" device included."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import tuning
from pdserve.kernels.fp8_gemm import triton as _fp8_tables  # noqa: F401  (registers its tables)
from pdserve.kernels.mla_decode import triton as _decode_tables  # noqa: F401


def test_cpu_takes_the_portable_entries() -> None:
    assert (
        tuning.lookup("fp8_gemm", "m<=1", torch.device("cpu"))
        is tuning._TABLES["fp8_gemm"]["any"]["m<=1"]
    )


@pytest.mark.gpu
def test_bare_cuda_device_is_the_current_device() -> None:
    named = torch.device("cuda", torch.cuda.current_device())
    for op, key in (("fp8_gemm", "m<=1"), ("mla_decode", "bf16,m64")):
        assert tuning.lookup(op, key, torch.device("cuda")) is tuning.lookup(op, key, named)
