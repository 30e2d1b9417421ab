"""Triton sample against the torch reference: the same token ids on batches mixing greedy,
temperature, top-k, top-p and min-p rows, with per-request seeds and steps.

Tolerance: none, ids must be equal. The reference's noise is a bit-exact integer hash, so the two
can differ only where two tokens' race values (or a token's mass-before and top_p) agree to fp32
rounding: on random logits that has a chance far below 1e-3 per test."""

from __future__ import annotations

import pytest
import torch
from _kernel_check import DEVICE, poison_outputs

from pdserve import kernels
from pdserve.kernels.sampling import ref
from pdserve.kernels.sampling import triton as tri

# (temperature, top_k, top_p, min_p): one row kind each, cycled over the batch
ROW_KINDS = [
    (0.0, 0, 1.0, 0.0),  # greedy
    (1.0, 0, 1.0, 0.0),  # plain temperature
    (0.7, 50, 1.0, 0.0),  # top-k
    (1.3, 0, 0.9, 0.0),  # top-p
    (1.0, 0, 1.0, 0.1),  # min-p
    (0.8, 20, 0.8, 0.05),  # all three
    (2.0, 1, 1.0, 0.0),  # top-k 1
    (1.0, 0, 0.0, 0.0),  # top-p 0: the most likely token only
    (0.5, 100000000, 0.999, 0.0),  # top-k beyond the vocab (disabled)
    (-1.0, 5, 0.5, 0.5),  # negative temperature: greedy despite filters
]


def _batch(batch: int, vocab: int, dtype: torch.dtype, scale: float, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=gen, device=DEVICE) * scale).to(dtype)
    kinds = [ROW_KINDS[(i * 7 + seed) % len(ROW_KINDS)] for i in range(batch)]
    temperature, top_k, top_p, min_p = (
        torch.tensor(col, device=DEVICE) for col in zip(*kinds, strict=True)
    )
    seeds = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen, device=DEVICE)
    steps = torch.randint(0, 2**40, (batch,), generator=gen, device=DEVICE)
    return logits, temperature.float(), top_k.int(), top_p.float(), min_p.float(), seeds, steps


CASES = [
    pytest.param(12, 1000, torch.float32, 3.0, id="b12-v1000-f32"),
    pytest.param(5, 777, torch.bfloat16, 1.0, id="b5-v777-bf16"),
    pytest.param(1, 3001, torch.float32, 8.0, id="b1-v3001-peaked"),
    pytest.param(256, 129280, torch.float32, 4.0, marks=pytest.mark.gpu, id="b256-v129280"),
    pytest.param(33, 129280, torch.bfloat16, 1.0, marks=pytest.mark.gpu, id="b33-v129280-bf16"),
    pytest.param(1, 129280, torch.float32, 2.0, marks=pytest.mark.gpu, id="b1-v129280"),
]


@pytest.mark.parametrize(("batch", "vocab", "dtype", "scale"), CASES)
def test_sample_matches_ref(batch, vocab, dtype, scale, monkeypatch: pytest.MonkeyPatch) -> None:
    poison_outputs(monkeypatch, tri)
    args = _batch(batch, vocab, dtype, scale, seed=batch + vocab)
    ids = tri.sample(*args)
    expected = ref.sample(*args)
    assert ids.dtype == torch.int64 and ids.shape == (batch,)
    bad = (ids != expected).nonzero().flatten().tolist()
    assert not bad, f"rows differ: {bad}"


def test_noise_is_bit_exact() -> None:
    """Flat logits, no filters: the winner is the argmax of the uniforms: pins down the hash."""
    batch, vocab = 16, 4099
    logits = torch.full((batch, vocab), 0.25, device=DEVICE)
    ones = torch.ones(batch, device=DEVICE)
    seeds = torch.arange(batch, device=DEVICE, dtype=torch.int64) * (2**33 + 12345) - 2**40
    steps = torch.arange(batch, device=DEVICE, dtype=torch.int64) * 3
    args = (logits, ones, torch.zeros(batch, dtype=torch.int32, device=DEVICE), ones, 0 * ones,
            seeds, steps)  # fmt: skip
    expected = ref.uniform_noise(seeds, steps, vocab).argmax(-1)
    assert torch.equal(tri.sample(*args), expected)
    assert torch.equal(ref.sample(*args), expected)


def test_draw_depends_only_on_seed_and_step() -> None:
    args = _batch(6, 500, torch.float32, 2.0, seed=5)
    ids = tri.sample(*args)
    perm = torch.tensor([3, 0, 5, 1, 4, 2], device=DEVICE)
    shuffled = tri.sample(*(a[perm] for a in args))
    assert torch.equal(shuffled, ids[perm])


def test_batch_invariant_mode_draws_the_same_in_any_batch() -> None:
    """In batch-invariant mode the vocab's cut does not follow the batch size, so a row draws the
    same token alone as in a batch of twelve (with filters, temperature and seeds of its own)."""
    cfg = {"BLOCK": 256, "programs_per_sm": 8}
    assert tri.vocab_splits(1, 129280, cfg, 132) != tri.vocab_splits(64, 129280, cfg, 132)
    with kernels.use_batch_invariant():
        cuts = {tri.vocab_splits(b, 129280, cfg, 132) for b in (1, 7, 64, 256)}
        assert len(cuts) == 1, cuts
    args = _batch(12, 3000, torch.float32, 2.0, seed=11)
    with kernels.use_batch_invariant():
        ids = tri.sample(*args)
        for i in (0, 3, 7, 11):
            assert torch.equal(tri.sample(*(a[i : i + 1] for a in args)), ids[i : i + 1]), i
    assert torch.equal(ids, ref.sample(*args))


def test_dispatch_runs_triton() -> None:
    args = _batch(4, 300, torch.float32, 2.0, seed=9)
    with kernels.use_backend("triton"):
        ids = kernels.sample(*args)
    assert torch.equal(ids, ref.sample(*args))


def test_rejects_bad_inputs() -> None:
    logits, temperature, top_k, top_p, min_p, seeds, steps = _batch(3, 100, torch.float32, 1.0, 1)
    with pytest.raises(ValueError, match="top_k"):
        tri.sample(logits, temperature, top_k.float(), top_p, min_p, seeds, steps)
    with pytest.raises(ValueError, match="temperature"):
        tri.sample(logits, temperature[:2], top_k, top_p, min_p, seeds, steps)
    with pytest.raises(ValueError, match="contiguous"):
        tri.sample(logits.t().contiguous().t(), temperature, top_k, top_p, min_p, seeds, steps)
