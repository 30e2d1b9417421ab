"""Sampling parameters and the batch sampler: validation names the field; a seeded draw depends only on the
request's seed and step, never on its neighbours in the batch; penalties and bans equal a plain torch
transcription of their formulas, row by row; log-probabilities are torch.log_softmax of the raw logits."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import PenaltyCounts, ban, sample, sample_tokens
from pdserve.engine.sampling_params import FinishReason, SamplingParams, check_stop, derive_seed
from pdserve.engine.step import SampleSpec
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
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
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


def reference_penalties(logits, prompt, generated, presence, frequency, repetition, banned=()):
    """The formulas written out token by token: Hugging Face's repetition penalty over prompt + output, then
    OpenAI's frequency and presence penalties over the output, then bans."""
    out = logits.clone().tolist()
    for t in set(prompt) | set(generated):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(generated):
        out[t] -= frequency * generated.count(t) + presence
    for t in banned:
        out[t] = float("-inf")
    return torch.tensor(out)


def test_penalties_equal_the_formulas_on_fixed_logits():
    torch.manual_seed(3)
    logits = torch.randn(64) * 4
    prompt, generated = [0, 5, 9, 9, 12], [12, 30, 30, 30, 7]
    for presence, frequency, repetition in [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.4),
                                            (-0.3, 1.1, 0.8), (1.5, -2.0, 1.9)]:  # fmt: skip
        params = SamplingParams(
            max_tokens=8, presence_penalty=presence, frequency_penalty=frequency,
            repetition_penalty=repetition, min_tokens=8, stop_token_ids=(40,),
        )  # fmt: skip
        spec = SampleSpec.of(params, len(generated), prompt + generated, eos_token_ids={1})
        expected = reference_penalties(
            logits, prompt, generated, presence, frequency, repetition, banned=(1, 40)
        )
        got = ban(PenaltyCounts().penalize("a", spec, logits), spec.banned_ids)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_penalty_counts_go_on_with_the_sampled_tokens_and_are_dropped_when_a_request_leaves():
    torch.manual_seed(6)
    logits = torch.randn(64) * 4
    prompt, generated = [0, 5, 9], [12, 30]
    params = SamplingParams(presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.2)
    counts = PenaltyCounts()
    counts.penalize("a", SampleSpec.of(params, 1, prompt + generated[:1]), logits)
    counts.sampled("a", generated[1])  # the runner counts what it sampled
    later = SampleSpec.of(params, 2, prompt + generated, counted=True)
    assert later.penalty_ids is None
    expected = reference_penalties(logits, prompt, generated, 0.3, 0.4, 1.2)
    torch.testing.assert_close(counts.penalize("a", later, logits), expected, rtol=1e-6, atol=1e-6)
    counts.keep({"b"})
    with pytest.raises(RuntimeError, match="request a: no penalty counts"):
        counts.penalize("a", later, logits)


def test_penalized_greedy_picks_the_reference_s_argmax_whatever_the_batch():
    torch.manual_seed(4)
    logits = torch.randn(3, 100)
    top = logits[0].argmax().item()
    params = SamplingParams(max_tokens=8, frequency_penalty=2.0, presence_penalty=2.0)
    spec = SampleSpec.of(params, 2, [0, 1, top, top], eos_token_ids=())  # carries its sequence
    expected = reference_penalties(logits[0], [0, 1], [top, top], 2.0, 2.0, 1.0).argmax().item()
    assert expected != top  # the penalty moves the greedy choice
    others = [SampleSpec.of(SamplingParams(temperature=0.8, seed=s), 0) for s in (1, 2)]
    alone, _ = sample(logits[:1], [spec])
    batched, _ = sample(logits, [spec, *others])
    assert alone[0] == batched[0] == expected


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, 1] = 10.0  # EOS, by far the likeliest
    logits[0, 4] = 9.0  # a stop token
    params = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(4,))
    held = [sample(logits, [SampleSpec.of(params, step, [0] * (3 + step), {1})])[0][0]
            for step in range(3)]  # fmt: skip
    assert held[0] == held[1] not in (1, 4) and held[2] == 1


def test_logprobs_are_the_raw_log_softmax_whatever_the_penalties():
    torch.manual_seed(5)
    logits = torch.randn(3, 80) * 3
    specs = [
        SampleSpec.of(SamplingParams(logprobs=5, temperature=0.7, seed=1, repetition_penalty=1.5), 1,
                      [3, 4, 5], ()),
        SampleSpec.of(SamplingParams(temperature=1.0, seed=2), 0),
        SampleSpec.of(SamplingParams(logprobs=0), 0),
    ]  # fmt: skip
    tokens, logprobs = sample(logits, specs)
    reference = torch.log_softmax(logits, dim=-1)
    first, none, only = logprobs
    assert none is None and only.top_ids == () and only.top_logprobs == ()
    assert only.logprob == pytest.approx(reference[2, tokens[2]].item(), abs=1e-6)
    assert first.logprob == pytest.approx(reference[0, tokens[0]].item(), abs=1e-6)
    values, ids = reference[0].topk(5)
    assert first.top_ids == tuple(ids.tolist())
    assert first.top_logprobs == pytest.approx(values.tolist(), abs=1e-6)
    alone_tokens, (alone,) = sample(logits[:1], specs[:1])
    assert (alone_tokens[0], alone) == (tokens[0], first)


def test_derived_seeds_keep_the_first_and_differ():
    seeds = [derive_seed(1234, i) for i in range(4)]
    assert seeds[0] == 1234 and len(set(seeds)) == 4
    assert seeds == [derive_seed(1234, i) for i in range(4)]
    assert all(0 <= s < 2**63 for s in seeds)
