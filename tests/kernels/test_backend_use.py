"""`kernels.use`: the kernel backend and batch-invariant mode travel in a context, not in os.environ; the
choice holds in the block and not in other threads (each worker thread enters it itself)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pdserve import kernels
from pdserve.kernels._backend import BACKEND_ENV, INVARIANT_ENV, backend_for, requested_backend


def test_use_sets_both_and_restores(monkeypatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv(INVARIANT_ENV, raising=False)
    env = dict(os.environ)
    with kernels.use(backend="ref", batch_invariant=True):
        assert requested_backend() == "ref" and kernels.batch_invariant()
        assert backend_for(torch.zeros(1)) == "ref"
        with kernels.use(batch_invariant=False):  # None keeps the surrounding backend
            assert requested_backend() == "ref" and not kernels.batch_invariant()
    assert requested_backend() == "auto" and not kernels.batch_invariant()
    assert dict(os.environ) == env


def test_use_does_not_cross_threads(monkeypatch) -> None:
    monkeypatch.delenv(INVARIANT_ENV, raising=False)
    seen = {}

    def other_thread() -> None:
        seen["plain"] = kernels.batch_invariant()
        with kernels.use(batch_invariant=True):
            seen["entered"] = kernels.batch_invariant()

    with kernels.use(batch_invariant=True):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen == {"plain": False, "entered": True}


def test_use_refuses_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match="kernel backend 'cuda'"), kernels.use(backend="cuda"):
        pass
