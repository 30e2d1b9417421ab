"""Chooses, per call, between a kernel's Triton implementation and its plain-torch reference.

The choice comes from (highest first): the `use_backend()` context, the `PDSERVE_KERNELS` environment variable
(`auto`, `ref` or `triton`), then `auto`: Triton for CUDA tensors when Triton imports, the reference otherwise.
Forcing `triton` on CPU tensors needs `TRITON_INTERPRET=1` (the interpreter runs the kernels on the CPU).
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


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
def use_backend(choice: str) -> Iterator[None]:
    """Within the block, run every kernel with `choice` (`auto`, `ref` or `triton`)."""
    if choice not in _CHOICES:
        raise ValueError(f"kernel backend {choice!r}: expected one of {', '.join(_CHOICES)}")
    token = _override.set(choice)
    try:
        yield
    finally:
        _override.reset(token)


def implementation(package: str, tensor: torch.Tensor):
    """The `ref` or `triton` module of the op package `package` to run for `tensor`."""
    import importlib

    return importlib.import_module(f"{package}.{backend_for(tensor)}")
