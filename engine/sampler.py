"""Samples one token per request from a batch of logits with each request's own parameters."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve import kernels

from .sampling_params import SamplingParams
from .step import SampleSpec


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams | SampleSpec], steps: Sequence[int]
) -> list[int]:
    """logits: [B, V]; params[b].seed must be set (see SamplingParams.with_seed); steps[b]: tokens request b has
    generated so far. The draw depends only on (seed, step), never on the batch."""
    device = logits.device

    def col(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    if all(p.temperature <= 0 for p in params):
        return logits.argmax(-1).tolist()
    ids = kernels.sample(
        logits,
        col([p.temperature for p in params], torch.float32),
        col([p.top_k for p in params], torch.int32),
        col([p.top_p for p in params], torch.float32),
        col([p.min_p for p in params], torch.float32),
        col([p.seed or 0 for p in params], torch.int64),
        col(list(steps), torch.int64),
    )
    return ids.tolist()
