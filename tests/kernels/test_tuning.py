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


def test_a_shape_entry_serves_that_shape_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_gemm takes "<class>,n=N,k=K" where the table has it, its class's entry for other shapes,
    and the phase's entry in batch-invariant mode (one config for every shape there)."""
    from pdserve.kernels._backend import forward_phase, use_batch_invariant

    cpu = torch.device("cpu")
    table = tuning._TABLES["fp8_gemm"]["any"]
    own = {**table["m<=1"], "GROUPS": 1}
    monkeypatch.setitem(table, "m<=1,n=256,k=512", own)
    assert tuning.find("fp8_gemm", "m<=1,n=256,k=512", cpu) is own
    assert tuning.find("fp8_gemm", "m<=1,n=256,k=640", cpu) is None
    assert _fp8_tables._gemm_config(1, 256, 512, cpu) is own
    assert _fp8_tables._gemm_config(1, 384, 512, cpu) is table["m<=1"]
    with use_batch_invariant(), forward_phase("decode"):
        assert _fp8_tables._gemm_config(1, 256, 512, cpu) is tuning.lookup(
            "fp8_gemm", "invariant-decode", cpu
        )
