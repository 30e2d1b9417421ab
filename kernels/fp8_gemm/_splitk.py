"""Split-K partial sums for the fp8 GEMM kernels, added in the same launch.

A GEMM whose output tiles alone cannot fill the GPU (decode shapes) splits K over several programs
per tile, each writing an fp32 partial sum to `part` [splits, M, N]. With a tile counter, the last
of a tile's programs to finish (counted with an atomic) adds the tile's partials in split order
and writes the output, then resets its counter for the next call; without one, a second kernel
adds them. Both add in split order 0, 1, ..., so the bits are the same either way.

The counters are one int32 a tile, zero between calls, kept per device and shared by every call on
it: calls on one device must not run concurrently on two streams (a worker runs its model on one).
They are allocated outside CUDA-graph capture; a call captured before they exist (or with more
tiles than they cover) takes the two-kernel path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MIN_COUNTERS = 4096


@triton.jit
def finish_tile(
    acc, part_ptrs, out_ptrs, mask, cnt_ptr, split, num_splits, stride_ps, FOLD: tl.constexpr
):  # fmt: skip
    """Stores this program's partial sum `acc` (part_ptrs: its tile in split 0); with FOLD, the
    tile's last program adds the splits' partials into out_ptrs (cnt_ptr: the tile's counter)."""
    tl.store(part_ptrs + split * stride_ps, acc, mask=mask)
    if FOLD:
        tl.debug_barrier()  # every thread's partial is stored before the count goes up
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            total = tl.zeros_like(acc)
            for s in range(num_splits):
                total += tl.load(
                    part_ptrs + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg"
                )
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr, 0)


@triton.jit
def _sum_splits_kernel(p_ptr, c_ptr, numel, splits, stride_ps, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(p_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """Zeroed tile counters for `tiles` tiles on `device`, or None where the launch should add the
    splits with a second kernel (during graph capture, before the counters exist or grow)."""
    have = _COUNTERS.get(device)
    if have is not None and have.numel() >= tiles:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    _COUNTERS[device] = torch.zeros(max(tiles, _MIN_COUNTERS), dtype=torch.int32, device=device)
    return _COUNTERS[device]


def prepare(out: torch.Tensor, splits: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """For a launch whose `tiles` output tiles are each split `splits` ways: where it writes (`out`
    itself, or fp32 partials [splits, M, N]), the tile counters to pass (any tensor when unused) and
    whether it adds the partials itself (FOLD)."""
    if splits == 1:
        return out, out, False
    part = torch.empty((splits, *out.shape), dtype=torch.float32, device=out.device)
    cnt = counters(out.device, tiles)
    return part, (out if cnt is None else cnt), cnt is not None


def finish(target: torch.Tensor, out: torch.Tensor, fold: bool) -> None:
    """After a launch set up by `prepare`: out = the partials' sum in split order, unless the
    launch wrote `out` or added them itself."""
    if target is out or fold:
        return
    numel, block = out.numel(), 1024
    _sum_splits_kernel[(triton.cdiv(numel, block),)](
        target, out, numel, target.shape[0], target.stride(0), BLOCK=block, num_warps=4
    )
