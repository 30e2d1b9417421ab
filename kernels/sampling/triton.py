"""Batched sampling in Triton: the same token ids as `ref.sample` (ties aside), without
materialising probs.

Every filter of the reference keeps the tokens whose probability reaches a per-row threshold (top-k:
the k-th largest; top-p: the last token of the smallest prefix whose mass reaches p; min-p: min_p *
p_max), and probability order is logit order, so the kept set is {i: logit_i >= tau, p_i >= min_p *
p_max} with tau the logit at the last rank top-k and top-p keep, and the draw is the argmax of p_i /
E_i over it. Passes:

1. `_stats_kernel`, grid (B, S): each program scans 1/S of a row: max and first argmax of the raw
logits (greedy), and the online softmax statistics (max m, sum s of exp(z - m)) of z = logits /
temperature. 2. Only for rows with top-k or top-p on: torch sorts those rows' logits (the order of z
for T > 0), and `_threshold_kernel` walks the sorted row, computing p from (m, s), accumulating the
mass before each rank, until the first rank that fails a filter; tau is the last kept logit. 3.
`_race_kernel`, grid (B, S): p_i = exp(z_i - m) / s, the counter-based noise u_i (lowbias32 of seed,
step and token id, bit-exact with the reference), E_i = -log(u_i), and the first argmax of p_i / E_i
over the kept tokens. 4. `_finalize_kernel`, grid (B,): combines the S partial winners per row
(first index on ties) and picks the greedy id for rows with temperature <= 0."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import batch_invariant
from ..tuning import lookup

_TEMPERATURE_FLOOR = 1e-6  # the reference clamps temperatures to this before dividing
_GOLDEN = 0x9E3779B9
_INT_MAX = 2**31 - 1

_empty = torch.empty
"""Output allocator; tests replace it to poison outputs before the kernel writes them."""


@triton.jit
def _lowbias32(x):
    """The reference's `hash_u32` on uint32 values (multiplications wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _first_argmax(values, ids, BIG: tl.constexpr):
    """(max of values, smallest id attaining it) along axis 0."""
    best = tl.max(values, 0)
    return best, tl.min(tl.where(values == best, ids, BIG), 0)


@triton.jit
def _stats_kernel(
    logits_ptr, temperature_ptr, part_ptr, vocab, stride_row, cols_per_split,
    NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr, T_FLOOR: tl.constexpr, BIG: tl.constexpr,
):  # fmt: skip
    """part[row, split] = (raw max, raw first argmax, max of z, sum of exp(z - max z)) over the
    split's columns."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.maximum(tl.load(temperature_ptr + row).to(tl.float32), T_FLOOR)
    lo = split * cols_per_split
    hi = tl.minimum(lo + cols_per_split, vocab)
    offs = tl.arange(0, BLOCK)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    raw_max = tl.full([], float("-inf"), tl.float32)
    raw_arg = tl.full([], BIG, tl.int32)
    z_max = tl.full([], float("-inf"), tl.float32)
    z_sum = tl.zeros([], tl.float32)
    for start in range(lo, hi, BLOCK):
        cols = start + offs
        ok = cols < hi
        x = tl.load(row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
        blk_max, blk_arg = _first_argmax(x, tl.where(ok, cols, BIG), BIG)
        raw_arg = tl.where(blk_max > raw_max, blk_arg, raw_arg)  # earlier block wins ties
        raw_max = tl.maximum(raw_max, blk_max)
        z = x / temp
        new_max = tl.maximum(z_max, tl.max(z, 0))
        use_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        z_sum = z_sum * tl.exp(z_max - use_max) + tl.sum(tl.exp(z - use_max), 0)
        z_max = new_max
    out = part_ptr + (row * NUM_SPLITS + split) * 4
    tl.store(out, raw_max)
    tl.store(out + 1, raw_arg.to(tl.float32, bitcast=True))
    tl.store(out + 2, z_max)
    tl.store(out + 3, z_sum)


@triton.jit
def _row_softmax_stats(part_ptr, row, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """(m, s) of the whole row from its split partials: max of z and sum of exp(z - m)."""
    splits = tl.arange(0, BLOCK_S)
    ok = splits < NUM_SPLITS
    base = part_ptr + (row * NUM_SPLITS + splits) * 4
    z_max = tl.load(base + 2, mask=ok, other=float("-inf"))
    z_sum = tl.load(base + 3, mask=ok, other=0.0)
    m = tl.max(z_max, 0)
    scale = tl.where(z_max == float("-inf"), 0.0, tl.exp(z_max - m))
    return m, tl.sum(z_sum * scale, 0)


@triton.jit
def _threshold_kernel(
    sorted_ptr, rows_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, part_ptr, tau_ptr,
    vocab, stride_sorted,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, T_FLOOR: tl.constexpr,
):  # fmt: skip
    """tau[row] = the logit at the last rank the reference keeps, from one row of logits sorted in
    descending order. A logit, not a probability: the race kernel's test (logit >= tau) is then
    exact and does not rely on two kernels recomputing p (through s) bit-identically."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    temp = tl.maximum(tl.load(temperature_ptr + row).to(tl.float32), T_FLOOR)
    k = tl.load(top_k_ptr + row).to(tl.int32)
    k = tl.where((k <= 0) | (k >= vocab), vocab, k)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    m, s = _row_softmax_stats(part_ptr, row, NUM_SPLITS, BLOCK_S)
    p_floor = tl.load(min_p_ptr + row).to(tl.float32) * (
        1.0 / s
    )  # min_p * p_max, p_max = exp(0) / s
    offs = tl.arange(0, BLOCK)
    src = sorted_ptr + i.to(tl.int64) * stride_sorted
    mass = tl.zeros([], tl.float32)
    tau = tl.full([], float("inf"), tl.float32)  # a logit
    start = tl.zeros([], tl.int32)
    keeping = start < vocab
    while keeping:  # the kept ranks are a prefix: stop at the first block that ends it
        ranks = start + offs
        x = tl.load(src + ranks, mask=ranks < vocab, other=float("-inf")).to(tl.float32)
        p = tl.exp(x / temp - m) / s
        mass_before = mass + tl.cumsum(p, 0) - p
        keep = (ranks < k) & ((mass_before < top_p) | (ranks == 0)) & (p >= p_floor)
        tau = tl.minimum(tau, tl.min(tl.where(keep, x, float("inf")), 0))
        mass += tl.sum(p, 0)
        start += BLOCK
        keeping = (start < vocab) & (tl.sum(keep.to(tl.int32), 0) == BLOCK)
    tl.store(tau_ptr + row, tau)


@triton.jit
def _race_kernel(
    logits_ptr, temperature_ptr, min_p_ptr, seeds_ptr, steps_ptr, tau_ptr, part_ptr, race_ptr,
    vocab, stride_row, cols_per_split,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, T_FLOOR: tl.constexpr,
    GOLDEN: tl.constexpr, BIG: tl.constexpr,
):  # fmt: skip
    """race[row, split] = (best p / E, its first token id) among the split's kept tokens (-1, BIG if
    none)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    out = race_ptr + (row * NUM_SPLITS + split) * 2
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    best = tl.full([], -1.0, tl.float32)
    best_id = tl.full([], BIG, tl.int32)
    if temperature > 0.0:  # greedy rows take their id from the stats pass
        temp = tl.maximum(temperature, T_FLOOR)
        m, s = _row_softmax_stats(part_ptr, row, NUM_SPLITS, BLOCK_S)
        tau = tl.load(tau_ptr + row)  # logit threshold of top-k / top-p (-inf when off)
        p_floor = tl.load(min_p_ptr + row).to(tl.float32) * (1.0 / s)  # min_p * p_max
        seed = tl.load(seeds_ptr + row).to(tl.int64)
        step = tl.load(steps_ptr + row).to(tl.int64)
        h = _lowbias32(seed.to(tl.uint32))
        h = _lowbias32(h ^ (seed >> 32).to(tl.uint32))
        h = _lowbias32(h ^ step.to(tl.uint32))
        lo = split * cols_per_split
        hi = tl.minimum(lo + cols_per_split, vocab)
        offs = tl.arange(0, BLOCK)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        for start in range(lo, hi, BLOCK):
            cols = start + offs
            ok = cols < hi
            x = tl.load(row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
            p = tl.exp(x / temp - m) / s
            bits = _lowbias32(h ^ (cols.to(tl.uint32) * tl.full(cols.shape, GOLDEN, tl.uint32)))
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            keep = ok & (x >= tau) & (p >= p_floor)
            race = tl.where(keep, p / -tl.log(u), -1.0)
            blk_best, blk_id = _first_argmax(race, tl.where(ok, cols, BIG), BIG)
            best_id = tl.where(blk_best > best, blk_id, best_id)
            best = tl.maximum(best, blk_best)
    tl.store(out, best)
    tl.store(out + 1, best_id.to(tl.float32, bitcast=True))


@triton.jit
def _finalize_kernel(
    temperature_ptr, part_ptr, race_ptr, out_ptr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BIG: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_S)
    ok = splits < NUM_SPLITS
    slot = row * NUM_SPLITS + splits
    if tl.load(temperature_ptr + row) > 0.0:
        values = tl.load(race_ptr + slot * 2, mask=ok, other=float("-inf"))
        ids = tl.load(race_ptr + slot * 2 + 1, mask=ok, other=0.0).to(tl.int32, bitcast=True)
    else:
        values = tl.load(part_ptr + slot * 4, mask=ok, other=float("-inf"))
        ids = tl.load(part_ptr + slot * 4 + 1, mask=ok, other=0.0).to(tl.int32, bitcast=True)
    # splits cover increasing columns, so the first split holding the max holds the first index
    _, token = _first_argmax(values, tl.where(ok, ids, BIG), BIG)
    tl.store(out_ptr + row, tl.where(token == BIG, 0, token).to(tl.int64))


def _check_inputs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> None:
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"logits must be a float [B, V] tensor, got {logits.dtype} {tuple(logits.shape)}"
        )
    if logits.stride(-1) != 1:
        raise ValueError(
            f"logits must be contiguous in the vocab dim, got strides {logits.stride()}"
        )
    if logits.shape[1] >= _INT_MAX:
        raise ValueError(f"vocab size {logits.shape[1]} too large")
    batch = logits.shape[0]
    for name, x, floating in (
        ("temperature", temperature, True), ("top_k", top_k, False), ("top_p", top_p, True),
        ("min_p", min_p, True), ("seeds", seeds, False), ("steps", steps, False),
    ):  # fmt: skip
        if x.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {tuple(x.shape)}")
        if x.device != logits.device:
            raise ValueError(f"{name} is on {x.device}, logits on {logits.device}")
        if x.dtype.is_floating_point != floating or x.dtype == torch.bool:
            kind = "a float" if floating else "an integer"
            raise ValueError(f"{name} must be {kind} tensor, got {x.dtype}")


def vocab_splits(batch: int, vocab: int, cfg: dict, num_sms: int) -> tuple[int, int]:
    """(programs per row, vocab columns per program): enough programs for the batch to fill the
    SMs. In batch-invariant mode the vocab is cut as for a batch of one whatever the batch, so a
    row's sums (and thresholds) come out the same in any batch."""
    block = cfg["BLOCK"]
    split_batch = 1 if batch_invariant() else batch
    num_splits = max(
        1,
        min(triton.cdiv(cfg["programs_per_sm"] * num_sms, split_batch), triton.cdiv(vocab, block)),
    )
    cols_per_split = triton.cdiv(triton.cdiv(vocab, num_splits), block) * block
    return triton.cdiv(vocab, cols_per_split), cols_per_split


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """See `ref.sample`. Syncs with the device once, to learn which rows need the sorted
    top-k/top-p path."""
    _check_inputs(logits, temperature, top_k, top_p, min_p, seeds, steps)
    batch, vocab = logits.shape
    out = _empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    if vocab == 0:
        raise ValueError("logits has an empty vocab dim")
    cfg = lookup("sampling", "default", logits.device)
    block = cfg["BLOCK"]
    if logits.is_cuda:
        num_sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
    else:
        num_sms = 1
    num_splits, cols_per_split = vocab_splits(batch, vocab, cfg, num_sms)
    block_s = triton.next_power_of_2(num_splits)
    common = dict(NUM_SPLITS=num_splits, T_FLOOR=_TEMPERATURE_FLOOR, num_warps=cfg["num_warps"])
    temperature = temperature.contiguous()

    part = torch.empty(batch, num_splits, 4, dtype=torch.float32, device=logits.device)
    _stats_kernel[(batch, num_splits)](
        logits, temperature, part, vocab, logits.stride(0), cols_per_split,
        BLOCK=block, BIG=_INT_MAX, **common,
    )  # fmt: skip

    tau = torch.full((batch,), float("-inf"), dtype=torch.float32, device=logits.device)
    filtered = (temperature > 0) & ((top_p < 1.0) | ((top_k > 0) & (top_k < vocab)))
    rows = torch.nonzero(filtered).flatten().to(torch.int32)  # the one host sync
    if rows.numel():
        sorted_logits = torch.sort(logits.index_select(0, rows), dim=-1, descending=True).values
        _threshold_kernel[(rows.numel(),)](
            sorted_logits, rows, temperature, top_k.contiguous(), top_p.contiguous(),
            min_p.contiguous(), part, tau, vocab, sorted_logits.stride(0),
            BLOCK_S=block_s, BLOCK=cfg["THRESHOLD_BLOCK"], **common,
        )  # fmt: skip

    race = torch.empty(batch, num_splits, 2, dtype=torch.float32, device=logits.device)
    _race_kernel[(batch, num_splits)](
        logits, temperature, min_p.contiguous(), seeds.contiguous(), steps.contiguous(), tau, part,
        race, vocab, logits.stride(0), cols_per_split,
        BLOCK_S=block_s, BLOCK=block, GOLDEN=_GOLDEN, BIG=_INT_MAX, **common,
    )  # fmt: skip
    _finalize_kernel[(batch,)](
        temperature, part, race, out, NUM_SPLITS=num_splits, BLOCK_S=block_s, BIG=_INT_MAX,
        num_warps=1,
    )  # fmt: skip
    return out
