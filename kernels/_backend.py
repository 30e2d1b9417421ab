"""Chooses, per call, between a kernel's Triton implementation and its plain-torch reference.

The choice comes from (highest first): the `use()` / `use_backend()` context, the `PDSERVE_KERNELS`
environment variable (`auto`, `ref` or `triton`), then `auto`: Triton for CUDA tensors when Triton imports,
the reference otherwise. Forcing `triton` on CPU tensors needs `TRITON_INTERPRET=1` (the interpreter runs the
kernels on the CPU).

Batch-invariant mode (`PDSERVE_BATCH_INVARIANT=1`, or the `use_batch_invariant()` context) makes every
token's arithmetic independent of the batch it runs in: dense GEMMs go through `kernels.matmul`'s
fixed-config Triton kernel instead of cuBLAS, and the Triton ops take one launch config and split
policy for every batch size (see each op's launcher). Greedy outputs then do not depend on which
requests share a step, at some cost in speed. It affects Triton paths only; the references are
plain torch. The fixed configs come in two sets, by `forward_phase()`: "prefill" (prompt tokens;
large tiles) and "decode" (generated tokens and anything outside a forward pass, such as the
logits; small tiles, split K). A token is always computed in the same phase whichever path runs
it, so invariance holds within each phase and outputs still match.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Literal

import torch

Backend = Literal["ref", "triton"]
BACKEND_ENV = "PDSERVE_KERNELS"
_CHOICES = ("auto", "ref", "triton")
_override: ContextVar[str | None] = ContextVar("pdserve_kernel_backend", default=None)
INVARIANT_ENV = "PDSERVE_BATCH_INVARIANT"
_invariant_override: ContextVar[bool | None] = ContextVar("pdserve_batch_invariant", default=None)
PHASES = ("prefill", "decode")
_phase: ContextVar[str] = ContextVar("pdserve_forward_phase", default="decode")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


PDL_ENV = "PDSERVE_PDL"


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use programmatic dependent launch (PDL, sm_90 and later; off with
    PDSERVE_PDL=0). Then the kernels that feed the decode GEMMs (rmsnorm, silu_mul, the activation
    quantizer, the GEMMs themselves) let the next kernel launch as soon as they start
    (`gdc_launch_dependents`), and the decode GEMMs, launched with `launch_pdl`, load their first
    weight tiles before they wait for the kernel before them (`gdc_wait`) and touch anything it
    wrote. A GEMM's weights must therefore not come from the kernel just before it. rmsnorm,
    silu_mul and the quantizer are launched with `launch_pdl` too and wait first thing (rmsnorm
    after loading its weight), so their launch overlaps the kernel before them."""
    if device.type != "cuda" or interpreter_enabled() or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return capability(device.index)[0] >= 9


@functools.cache
def capability(index: int | None) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device `index`, looked up once."""
    return torch.cuda.get_device_capability(index)


def requested_backend() -> str:
    """The backend asked for by the context or the environment: `auto`, `ref` or `triton`."""
    choice = _override.get() or os.environ.get(BACKEND_ENV, "auto")
    if choice not in _CHOICES:
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected one of {', '.join(_CHOICES)}")
    return choice


def backend_for(tensor: torch.Tensor) -> Backend:
    """The implementation to run for an op whose main input is `tensor`."""
    choice = requested_backend()
    if choice == "ref":
        return "ref"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError(f"{BACKEND_ENV}=triton but triton is not installed")
        if not tensor.is_cuda and not interpreter_enabled():
            raise RuntimeError(
                f"{BACKEND_ENV}=triton with {tensor.device} tensors needs TRITON_INTERPRET=1 "
                "(or use the reference kernels with --kernels ref)"
            )
        return "triton"
    return "triton" if tensor.is_cuda and triton_available() else "ref"


@contextlib.contextmanager
def _set(var: ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextlib.contextmanager
def use_backend(choice: str) -> Iterator[None]:
    """Within the block, run every kernel with `choice` (`auto`, `ref` or `triton`)."""
    if choice not in _CHOICES:
        raise ValueError(f"kernel backend {choice!r}: expected one of {', '.join(_CHOICES)}")
    with _set(_override, choice):
        yield


INTERPRETER_SMS = 4
"""SM count the split policies assume without a GPU (the interpreter), so tests exercise splits."""


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SM count (INTERPRETER_SMS off CUDA), for launchers that size grids to it."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_ok(t: torch.Tensor) -> bool:
    """Whether a 2-D view of t can back a TMA descriptor: unit last stride, 16-byte aligned base
    and row stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0


def implementation(package: str, tensor: torch.Tensor):
    """The `ref` or `triton` module of the op package `package` to run for `tensor`."""
    import importlib

    return importlib.import_module(f"{package}.{backend_for(tensor)}")


def batch_invariant() -> bool:
    """Whether batch-invariant mode is on (the context first, then `PDSERVE_BATCH_INVARIANT`)."""
    override = _invariant_override.get()
    if override is not None:
        return override
    value = os.environ.get(INVARIANT_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{INVARIANT_ENV}={value!r}: expected 0 or 1")
    return value == "1"


@contextlib.contextmanager
def use_batch_invariant(on: bool = True) -> Iterator[None]:
    """Within the block, batch-invariant mode is `on` whatever the environment says."""
    with _set(_invariant_override, bool(on)):
        yield


@contextlib.contextmanager
def use(backend: str | None = None, batch_invariant: bool | None = None) -> Iterator[None]:
    """Within the block, kernels run with `backend` and batch-invariant mode `batch_invariant` (None keeps
    the surrounding choice). A context variable: every thread that runs kernels (a worker's loop thread, not
    only the thread that built it) must enter it itself."""
    with contextlib.ExitStack() as stack:
        if backend is not None:
            stack.enter_context(use_backend(backend))
        if batch_invariant is not None:
            stack.enter_context(use_batch_invariant(batch_invariant))
        yield


@contextlib.contextmanager
def forward_phase(phase: str) -> Iterator[None]:
    """Within the block, batch-invariant kernels take `phase`'s fixed configs ("prefill" or "decode";
    "decode" outside any block)."""
    if phase not in PHASES:
        raise ValueError(f"forward phase {phase!r}: expected one of {', '.join(PHASES)}")
    with _set(_phase, phase):
        yield


def invariant_phase() -> str | None:
    """None outside batch-invariant mode; in it, the phase whose fixed configs kernels take."""
    return _phase.get() if batch_invariant() else None
