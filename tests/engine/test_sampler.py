"""Sampling parameters and the batch sampler: validation names the field; a seeded draw depends only on the
request's seed and step, never on its neighbours in the batch."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import sample_tokens
from pdserve.engine.sampling_params import FinishReason, SamplingParams, check_stop
from pdserve.model.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_draw_depends_only_on_seed_and_step():
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.7, seed=s) for s in (1, 2, 3)]
    alone = [sample_tokens(logits[:1], [p], [step])[0] for step in range(20)]
    batched = [sample_tokens(logits, [p, *others], [step, 5, 6, 7])[0] for step in range(20)]
    assert alone == batched
    assert len(set(alone)) > 3, "different steps draw different tokens"
    assert sample_tokens(logits[:1], [SamplingParams(temperature=1.0, seed=99)], [0]) is not None


def test_greedy_and_top_k_1_agree_with_argmax():
    logits = torch.randn(3, 50)
    greedy = sample_tokens(logits, [SamplingParams()] * 3, [0, 0, 0])
    top1 = sample_tokens(logits, [SamplingParams(temperature=2.0, top_k=1, seed=5)] * 3, [0, 1, 2])
    assert greedy == top1 == logits.argmax(-1).tolist()


def test_stop_rules():
    p = SamplingParams(max_tokens=3, stop_token_ids=(7,))
    assert check_stop(p, 1, 1, {1}) == FinishReason.STOP
    assert check_stop(p, 7, 1, {1}) == FinishReason.STOP
    assert check_stop(p, 5, 3, {1}) == FinishReason.LENGTH
    assert check_stop(p, 5, 2, {1}) is None
    assert check_stop(SamplingParams(ignore_eos=True), 1, 1, {1}) is None
