"""MTP speculation: greedy outputs identical to one token a step (the tiny model's own MTP module and an oracle
draft of known acceptance), and speculative sampling's tokens following the target's distribution (a
chi-square test over a small vocabulary, drafts drawn from a different distribution)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pdserve import kernels
from pdserve.engine.drafter import OracleDrafter
from pdserve.engine.offline import OfflineGenerator
from pdserve.engine.sampler import PenaltyCounts
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.speculative import DraftProbs, _kept, draft_tokens, verify
from pdserve.engine.step import DecodeRow, SampleSpec

PROMPTS = [list(range(5, 40)), [3, 9, 27, 81, 243, 729, 1000, 7] * 3]


def generate(model, prompt, params, num_drafts=0, drafter=None, chunk=None):
    gen = OfflineGenerator(model, 16, chunk, num_drafts=num_drafts, drafter=drafter)
    return gen.generate(prompt, params)


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_greedy_speculation_gives_the_tokens_of_one_token_a_step(reference_model, num_drafts):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with kernels.use_batch_invariant():
        for prompt in PROMPTS:
            plain = generate(reference_model, prompt, params)
            mtp = generate(reference_model, prompt, params, num_drafts, chunk=16)
            assert mtp.token_ids == plain.token_ids
            assert mtp.num_drafted > 0
            for acceptance in (1.0, 0.6):
                seq = {"offline": prompt + plain.token_ids}

                def oracle(model, cache, seq=seq, acceptance=acceptance):
                    return OracleDrafter(model, cache, seq, acceptance, seed=3)

                got = generate(reference_model, prompt, params, num_drafts, oracle)
                assert got.token_ids == plain.token_ids, acceptance
                if acceptance == 1.0:  # every draft accepted: K + 1 tokens a step
                    assert got.num_accepted == got.num_drafted > 0
                    assert got.num_steps <= 2 + math.ceil(24 / (num_drafts + 1))
                else:
                    assert 0 < got.num_accepted < got.num_drafted


def test_stop_tokens_and_max_tokens_cut_a_verify_group(reference_model):
    prompt = PROMPTS[0]
    with kernels.use_batch_invariant():
        plain = generate(reference_model, prompt, SamplingParams(max_tokens=20, ignore_eos=True))
        seq = {"offline": prompt + plain.token_ids}
        stop = plain.token_ids[9]
        params = SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,))
        want = generate(reference_model, prompt, params)
        for k in (2, 4):
            got = generate(
                reference_model, prompt, params, k,
                lambda m, c: OracleDrafter(m, c, seq, 1.0),
            )  # fmt: skip
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
            short = SamplingParams(max_tokens=7, ignore_eos=True)
            got = generate(
                reference_model, prompt, short, k, lambda m, c: OracleDrafter(m, c, seq, 1.0)
            )
            assert got.token_ids == plain.token_ids[:7] and got.finish_reason == "length"


def test_sampled_speculation_with_penalties_and_logprobs_runs(reference_model):
    params = SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=5, presence_penalty=0.5,
        repetition_penalty=1.2, logprobs=2, min_tokens=4,
    )  # fmt: skip
    got = generate(reference_model, PROMPTS[1], params, 2)
    assert len(got.token_ids) == 16 and got.num_drafted > 0
    assert all(0 <= t < reference_model.args.vocab_size for t in got.token_ids)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells with expected count >= 5 (the rest pooled) and its degrees of
    freedom."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return stat, int(keep.sum()) - 1


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}
"""The chi-square distribution's 0.999 quantile by degrees of freedom."""


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "with_q"),
    [(1.0, 1.0, -1, True), (0.7, 0.9, -1, True), (1.3, 1.0, 4, True), (1.0, 1.0, -1, False)],
)
def test_speculative_sampling_follows_the_target_distribution(temperature, top_p, top_k, with_q):
    """Two drafts per trial, drawn from the draft logits (with_q: verified with their q; else as point
    masses); the first token must follow the target's distribution at row 0, and the second, where the
    first draft was accepted, the target's at row 1."""
    vocab, trials = 8, 6000
    g = torch.Generator().manual_seed(0)
    target = torch.randn(3, vocab, generator=g) * 1.5  # rows 0..2 of one verify group
    draft = torch.randn(2, vocab, generator=g) * 1.5
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    probs = DraftProbs()
    # one verify call over every trial: trial t is request t, seeded t (a row never depends on its batch)
    specs = [SampleSpec(temperature, top_p, top_k, 0.0, seed, 10) for seed in range(trials)]
    d1, q1 = draft_tokens(draft[:1].expand(trials, -1), specs, [10] * trials)
    d2, q2 = draft_tokens(draft[1:].expand(trials, -1), specs, [11] * trials)
    rows = []
    for t, spec in enumerate(specs):
        probs.put(str(t), torch.stack([q1[t], q2[t]]) if with_q else None)
        rows += [
            DecodeRow(str(t), 1, 20, [0, 1], spec, drafts=2),
            DecodeRow(str(t), d1[t], 21, [0, 1], dataclasses.replace(spec, step=11)),
            DecodeRow(str(t), d2[t], 22, [0, 1], dataclasses.replace(spec, step=12)),
        ]
    v = verify(target.repeat(trials, 1), rows, PenaltyCounts(), probs)
    for t in range(trials):
        first[v.tokens[3 * t]] += 1
        if v.accepted[3 * t] >= 2:
            second[v.tokens[3 * t + 1]] += 1
    for counts, row in ((first, 0), (second, 1)):
        spec = SampleSpec(temperature, top_p, top_k, 0.0, 0, 0)
        p = _kept(target[row : row + 1], [spec])[0]
        stat, dof = _chi_square(counts, p)
        assert stat < CHI2_999[dof], (row, stat, dof, counts.tolist(), p.tolist())
        assert counts[p == 0].sum() == 0  # nothing the filters drop
    assert second.sum() > trials / 20  # the second row was tested on enough trials


def test_relaxed_acceptance_takes_a_near_best_draft_only_on_relaxed_greedy_rows():
    """Row 0's logits: token 3 best, token 5 0.3 below it, token 7 2.0 below. With relaxed (top-3, 0.5):
    draft 5 is accepted on a relaxed row and its tokens go on from it; draft 7 is not (too far); a strict row
    and a sampled row accept neither."""
    logits = torch.full((2, 10), -10.0)
    logits[0, 3], logits[0, 5], logits[0, 7] = 0.0, -0.3, -2.0
    logits[1, 4] = 0.0

    def group(draft, relaxed, temperature=0.0):
        spec = SampleSpec(temperature, 1.0, -1, 0.0, 1, 0, relaxed=relaxed)
        return [
            DecodeRow("r", 1, 10, [0], spec, drafts=1),
            DecodeRow("r", draft, 11, [0], dataclasses.replace(spec, step=1)),
        ]

    def run(rows):
        v = verify(logits, rows, PenaltyCounts(), None, relaxed=(3, 0.5))
        return v.tokens[: v.accepted[0]]

    assert run(group(5, relaxed=True)) == [5, 4]
    assert run(group(7, relaxed=True)) == [3]
    assert run(group(5, relaxed=False)) == [3]
    assert verify(logits, group(5, True), PenaltyCounts()).tokens[:1] == [3]  # server off
    assert len(run(group(5, relaxed=True, temperature=1.0))) in (
        1,
        2,
    )  # the sampling rule, not relaxed
