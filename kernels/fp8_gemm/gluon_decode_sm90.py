"""The fp8 block-scaled GEMM at decode sizes (M <= 64) for Hopper (sm_90), in Gluon: a
warp-specialized TMA ring, whole n-tiles or stream-K.

Why: at M = 64 the weight is the traffic, and the tl.dot kernel of `triton.py` leaves only one
k-tile's copies in flight while it waits for the next (its pipeliner issues the copies of k-tile
i + 2 after the MMA's wait and the scaling). Here:

- one producer warp keeps the ring full: it issues the next k-tile's loads as soon as a slot
  frees, across output-tile boundaries, so STAGES k-tiles stay in flight whatever the consumer is
  doing. A's and B's k-tiles come by TMA; the k-tile's scales (the 64 rows' a_scale, the weight
  block's scale repeated 64 times) by cp.async, tied to the same `ready` mbarrier. Loaded by the
  consumer instead, their L2 round trip under the weight stream sat in every k-tile and slowed
  the whole loop;
- the consumer warpgroup waits for a slot, issues its wgmma, reads the scales from the slot, waits
  for the wgmma, frees the slot and scales the product into the fp32 accumulator;
- the work: the (n-tile, k-tile) iterations, n-tile major, are numbered 0 .. tiles * KT and CTA c
  takes the run [c * W, (c + 1) * W). Where the n-tiles fill most of the SMs, W is a whole
  number of n-tiles (KT each; o: one n-tile a CTA, mlp_w13: five) and there are no partial sums.
  Else W spreads the iterations evenly over the SMs (stream-K), and a CTA's run covers the end of
  one n-tile, whole n-tiles and the start of another;
- an n-tile cut over several CTAs ("pieces", numbered in run order) is finished by the last of them
  to arrive: each stores its fp32 partial to part[piece] and counts itself in on the tile's counter
  (see `_splitk.py`), and the last adds the pieces in piece order and writes the tile. The sum's
  order does not depend on which CTA arrives last, so the result is the same bits every run;
- an n-tile may be BOXES (2 or 3) boxes of BLOCK_N rows, each with its wgmma and accumulator
  (`_consumer_boxes`, whole n-tiles only): q_b's 24576 rows in 128 tiles of 192, one a CTA, where
  128-row tiles made 96 CTAs, and a CTA's own streaming rate is bounded, so 96 of them fell
  short of HBM's bandwidth;
- at M <= cfg["direct_max_m"], whole tiles are stored straight from the MMA's registers, without
  the trip through shared memory that wide stores need (narrow stores, so only for a few rows);
- with PDL (`_backend.pdl_enabled`), the producer loads the first STAGES k-tiles of the weight,
  then waits for the kernel before (`gdc_wait`) before A, the scales and the rest; nothing is
  stored before that wait.

A: [M, K] e4m3 (M <= 64, brought into wgmma's 64-row tile; see `_a_descriptors`) with a_scale
[M, K/128]; B: [N, K] e4m3 with b_scale [N/128, K/128]; BLOCK_N divides 128, so a tile's weight
scale is one number per k-tile. Needs what `gluon_sm90_common.available` says.
"""

from __future__ import annotations

import torch
import triton

from .._backend import num_sms, pdl_enabled
from ..gluon_sm90_common import IMPORTED, available
from . import _splitk

if IMPORTED:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from ..gluon_sm90_common import (
        TensorDescriptor,
        gl,
        gluon,
        mbarrier,
        tma_load,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

__all__ = ["available", "launch", "MAX_M"]

MAX_M = 64


if IMPORTED:

    @gluon.jit
    def _load_b(b_desc, bar, b_bufs, s, g, KT, A_BYTES: gl.constexpr, BOXES: gl.constexpr):
        """Arms `bar` for a k-tile's bytes (A's and the weight's) and issues the weight's k-tile of
        iteration g (n-tile g // KT, k-tile g % KT): BOXES boxes of BLOCK_N rows, into ring slot
        s's buffers s * BOXES + j."""
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = b_desc.block_type.shape[1]
        mbarrier.expect(bar, A_BYTES + BOXES * b_desc.block_type.nbytes)
        row = (g // KT) * (BOXES * BLOCK_N)
        for j in gl.static_range(BOXES):
            tma_load(
                b_desc, [row + j * BLOCK_N, (g % KT) * BLOCK_K], bar, b_bufs.index(s * BOXES + j)
            )

    @gluon.jit
    def _producer(a_desc, a2_desc, b_desc, a_bufs, b_bufs, sc_bufs, ready, empty, as_ptr, bs_ptr,
                  M, start, end, KT, stride_asm, stride_ask, stride_bsn, stride_bsk,
                  STAGES: gl.constexpr, BOXES: gl.constexpr, TWO_A: gl.constexpr,
                  PDL: gl.constexpr):  # fmt: skip
        """One warp: the loads of iterations start .. end into ring slot (g - start) % STAGES, once
        the consumer has released the slot's previous k-tile: A's and B's k-tile by TMA, and the
        k-tile's scales by cp.async (into scale row (BOXES + 1) * s the a_scale of the 64 rows, into
        the next BOXES rows each box's weight scale 64 times), all completing the slot's `ready`
        barrier."""
        BLOCK_N: gl.constexpr = b_bufs.shape[1]
        BLOCK_K: gl.constexpr = b_bufs.shape[2]
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        A_ROWS: gl.constexpr = a_desc.block_type.shape[0]
        A2_ROWS: gl.constexpr = a2_desc.block_type.shape[0] if TWO_A else 0
        A_BYTES: gl.constexpr = a_desc.block_type.nbytes + (
            a2_desc.block_type.nbytes if A2_ROWS else 0
        )
        lane: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
        a_off = gl.minimum(gl.arange(0, BLOCK_M, layout=lane), M - 1) * stride_asm
        b_off = gl.zeros([BLOCK_M], gl.int32, lane)
        if PDL:
            # the weight's first k-tiles need nothing from the kernel before: load them, then
            # wait for it (its writes to A, its scales and our `out`) before the rest
            for g in range(start, gl.minimum(end, start + STAGES)):
                _load_b(b_desc, ready.index(g - start), b_bufs, g - start, g, KT, A_BYTES, BOXES)
            gdc_wait()
        for g in range(start, end):
            i = g - start
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the first round passes
            bar = ready.index(s)
            tile = g // KT
            kt = g % KT
            async_copy.async_copy_global_to_shared(
                sc_bufs.index((BOXES + 1) * s), as_ptr + a_off + kt * stride_ask
            )
            for j in gl.static_range(BOXES):
                box = tile * BOXES + j
                b_scale = bs_ptr + (box * BLOCK_N // BLOCK_K) * stride_bsn + kt * stride_bsk
                async_copy.async_copy_global_to_shared(
                    sc_bufs.index((BOXES + 1) * s + 1 + j), b_scale + b_off
                )
            async_copy.mbarrier_arrive(bar)  # before the expect, so the phase waits for it
            if i >= STAGES * PDL:  # else the PDL prologue above has issued them
                _load_b(b_desc, bar, b_bufs, s, g, KT, A_BYTES, BOXES)
            # A's rows come as one or two boxes of a power of two rows (`_a_descriptors`); the smem
            # rows past them are left as they are: only output rows past M, never stored, read them
            a_dst = a_bufs.index(s)
            if A_ROWS == BLOCK_M:
                tma_load(a_desc, [0, kt * BLOCK_K], bar, a_dst)
            else:  # noqa: PLR5501 (gluon.jit: constexpr branches)
                tma_load(a_desc, [0, kt * BLOCK_K], bar, a_dst.slice(0, A_ROWS))
                if A2_ROWS:
                    tma_load(a2_desc, [A_ROWS, kt * BLOCK_K], bar, a_dst.slice(A_ROWS, A2_ROWS))

    @gluon.jit
    def _store_direct(acc, out_ptr, M, N, col0, stride_om):
        """acc [64, BLOCK_N] to out's columns col0.., rows < M, straight from the MMA's registers (no
        trip through shared memory; the stores are narrow, so only for a few rows)."""
        BLOCK_M: gl.constexpr = acc.shape[0]
        BLOCK_N: gl.constexpr = acc.shape[1]
        layout: gl.constexpr = acc.type.layout
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _blocked_tile(acc, out_ptr, M, N, col0, stride_om):
        """acc in a blocked layout for coalesced stores, with the output pointers and mask of its
        rows and columns col0.., and its offsets in an [M, N] fp32 partial sum."""
        BLOCK_M: gl.constexpr = acc.shape[0]
        BLOCK_N: gl.constexpr = acc.shape[1]
        TPW_N: gl.constexpr = BLOCK_N // 4
        blocked: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TPW_N, TPW_N], [4, 1], [1, 0])
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blocked))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, blocked))
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        return gl.convert_layout(acc, blocked), out_ptrs, mask, rows[:, None] * N + cols[None, :]

    @gluon.jit
    def _store_tile(acc, out_ptr, M, N, col0, stride_om, DIRECT: gl.constexpr):
        """A whole output tile (or box) of acc's width at columns col0.."""
        if DIRECT:
            _store_direct(acc, out_ptr, M, N, col0, stride_om)
        else:
            acc, out_ptrs, mask, _ = _blocked_tile(acc, out_ptr, M, N, col0, stride_om)
            gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _store_piece(acc, part_ptr, out_ptr, cnt_ptr, M, N, KT, W, tile, stride_ps, stride_om,
                     MAX_PIECES: gl.constexpr, DIRECT: gl.constexpr):  # fmt: skip
        """The tile's output, or this CTA's piece of it (see the module note)."""
        if MAX_PIECES == 1:  # whole n-tiles: no partial sums (part_ptr and cnt_ptr are unused)
            _store_tile(acc, out_ptr, M, N, tile * acc.shape[1], stride_om, DIRECT)
        else:
            acc, out_ptrs, mask, part_offs = _blocked_tile(
                acc, out_ptr, M, N, tile * acc.shape[1], stride_om
            )
            first = (tile * KT) // W
            pieces = ((tile + 1) * KT - 1) // W - first + 1
            if pieces == 1:
                gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            else:
                part_ptrs = part_ptr + part_offs
                gl.store(part_ptrs + (gl.program_id(0) - first) * stride_ps, acc, mask=mask)
                gl.thread_barrier()  # every thread's partial is stored before the count goes up
                arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
                if arrived == pieces - 1:
                    # every piece's loads in flight at once; the sum in piece order
                    total = gl.zeros_like(acc)
                    for p in gl.static_range(MAX_PIECES):
                        total += gl.load(part_ptrs + p * stride_ps, mask=mask & (p < pieces),
                                         other=0.0, cache_modifier=".cg")  # fmt: skip
                    gl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
                    gl.atomic_xchg(cnt_ptr + tile, 0)

    @gluon.jit
    def _consumer(a_bufs, b_bufs, sc_bufs, ready, empty, part_ptr, out_ptr, cnt_ptr, M, N, KT, W,
                  start, end, stride_ps, stride_om, STAGES: gl.constexpr, MAX_PIECES: gl.constexpr,
                  BOXES: gl.constexpr, DIRECT: gl.constexpr):  # fmt: skip
        """One warpgroup: the iterations start .. end, an output tile (or piece) at a time; tiles
        of several boxes in `_consumer_boxes`."""
        BLOCK_N: gl.constexpr = b_bufs.shape[1]
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
        )
        if BOXES > 1:
            _consumer_boxes(a_bufs, b_bufs, sc_bufs, ready, empty, out_ptr, M, N, KT, start, end,
                            stride_om, STAGES, BOXES, DIRECT, mma)  # fmt: skip
        else:
            row: gl.constexpr = gl.SliceLayout(1, mma)
            prod = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
            i = 0
            for tile in range((start // KT), (end - 1) // KT + 1):
                t0 = tile * KT
                acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
                for _ in range(gl.maximum(start, t0), gl.minimum(end, t0 + KT)):
                    s = i % STAGES
                    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                    prod = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), prod,
                                         use_acc=False, is_async=True)  # fmt: skip
                    scale = sc_bufs.index(2 * s).load(row) * sc_bufs.index(2 * s + 1).load(row)
                    prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod,))
                    mbarrier.arrive(empty.index(s), count=1)
                    acc += prod * scale[:, None]
                    i += 1
                _store_piece(acc, part_ptr, out_ptr, cnt_ptr, M, N, KT, W, tile, stride_ps, stride_om,
                             MAX_PIECES, DIRECT)  # fmt: skip

    @gluon.jit
    def _consumer_boxes(a_bufs, b_bufs, sc_bufs, ready, empty, out_ptr, M, N, KT, start, end,
                        stride_om, STAGES: gl.constexpr, BOXES: gl.constexpr,
                        DIRECT: gl.constexpr, mma: gl.constexpr):  # fmt: skip
        """As `_consumer` for tiles of BOXES (2 or 3) boxes of BLOCK_N rows, whole n-tiles only: a
        wgmma and an accumulator a box (Gluon tensors are powers of two wide, 192 is not); mma:
        the wgmma's accumulator layout."""
        BLOCK_N: gl.constexpr = b_bufs.shape[1]
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        row: gl.constexpr = gl.SliceLayout(1, mma)
        p0 = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        p1 = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        p2 = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        i = 0
        for tile in range((start // KT), (end - 1) // KT + 1):
            acc0 = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
            acc1 = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
            acc2 = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
            for _ in range(KT):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                a = a_bufs.index(s)
                b = s * BOXES
                p0 = warpgroup_mma(a, b_bufs.index(b).permute((1, 0)), p0, use_acc=False,
                                   is_async=True)  # fmt: skip
                p1 = warpgroup_mma(a, b_bufs.index(b + 1).permute((1, 0)), p1, use_acc=False,
                                   is_async=True)  # fmt: skip
                if BOXES == 3:
                    p2 = warpgroup_mma(a, b_bufs.index(b + 2).permute((1, 0)), p2, use_acc=False,
                                       is_async=True)  # fmt: skip
                sc = (BOXES + 1) * s
                a_scale = sc_bufs.index(sc).load(row)
                s0 = a_scale * sc_bufs.index(sc + 1).load(row)
                s1 = a_scale * sc_bufs.index(sc + 2).load(row)
                if BOXES == 3:
                    s2 = a_scale * sc_bufs.index(sc + 3).load(row)
                    p0, p1, p2 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1, p2))
                else:
                    p0, p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1))
                mbarrier.arrive(empty.index(s), count=1)
                acc0 += p0 * s0[:, None]
                acc1 += p1 * s1[:, None]
                if BOXES == 3:
                    acc2 += p2 * s2[:, None]
                i += 1
            col = tile * (BOXES * BLOCK_N)
            _store_tile(acc0, out_ptr, M, N, col, stride_om, DIRECT)
            _store_tile(acc1, out_ptr, M, N, col + BLOCK_N, stride_om, DIRECT)
            if BOXES == 3:
                _store_tile(acc2, out_ptr, M, N, col + 2 * BLOCK_N, stride_om, DIRECT)

    @gluon.jit
    def _decode_kernel(
        a_desc, a2_desc, b_desc, as_ptr, bs_ptr, part_ptr, out_ptr, cnt_ptr, M, N, KT, W, total,
        stride_asm, stride_ask, stride_bsn, stride_bsk, stride_ps, stride_om,
        STAGES: gl.constexpr, MAX_PIECES: gl.constexpr, TWO_A: gl.constexpr, PDL: gl.constexpr,
        BOXES: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = 64  # wgmma's M; A's descriptor may bring fewer rows
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        if PDL:
            gdc_launch_dependents()
        start = gl.program_id(0) * W
        end = gl.minimum(start + W, total)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(
            b_desc.dtype, [STAGES * BOXES, BLOCK_N, BLOCK_K], b_desc.layout
        )
        sc_bufs = gl.allocate_shared_memory(
            gl.float32, [(BOXES + 1) * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(STAGES):
            mbarrier.init(ready.index(slot), count=1)
            mbarrier.init(empty.index(slot), count=1)
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (a_bufs, b_bufs, sc_bufs, ready, empty, part_ptr, out_ptr, cnt_ptr, M, N, KT,
                     W, start, end, stride_ps, stride_om, STAGES, MAX_PIECES, BOXES, DIRECT),
                ),
                (
                    _producer,
                    (a_desc, a2_desc, b_desc, a_bufs, b_bufs, sc_bufs, ready, empty, as_ptr,
                     bs_ptr, M, start, end, KT, stride_asm, stride_ask, stride_bsn, stride_bsk,
                     STAGES, BOXES, TWO_A, PDL),
                ),
            ],
            [1],
            [40],
        )  # fmt: skip


def plan(n: int, k: int, cfg: dict, sms: int, block_k: int) -> tuple[int, int, int]:
    """(iterations a CTA, CTAs, the most pieces an n-tile is cut into) on a GPU of `sms` SMs.
    Whole n-tiles, the same number a CTA, where the CTAs they make hold at least
    cfg["whole_tiles_fill"] of what that many a CTA could (no partial sums: o and mlp_w2, 112
    n-tiles of 64 on 132 SMs; q_b, 384 n-tiles, 3 a CTA on 128); else stream-K over the SMs."""
    kt = triton.cdiv(k, block_k)
    tiles = triton.cdiv(n, cfg["BLOCK_N"] * cfg.get("boxes", 1))
    per = triton.cdiv(tiles, sms)
    if tiles >= cfg["whole_tiles_fill"] * sms * per:
        return kt * per, triton.cdiv(tiles, per), 1
    w = triton.cdiv(tiles * kt, sms)
    return w, triton.cdiv(tiles * kt, w), triton.cdiv(kt, w) + 1


def ring_slots(w: int, cfg: dict) -> int:
    """The ring's slots for a CTA's run of w iterations: num_stages, cut to a cfg["run_per_slot"]-th
    of the run (at least min_stages). Short runs (qkv_a, 14 iterations a CTA) were faster with
    fewer slots. A guess, not profiled: the deep ring's shared memory keeps the next kernel's
    CTAs, launched early by PDL, off the SM until this one's leave."""
    per = cfg.get("run_per_slot")
    if not per:
        return cfg["num_stages"]
    return max(cfg.get("min_stages", 4), min(cfg["num_stages"], w // per))


def _a_descriptors(a: torch.Tensor, block_k: int):
    """TMA descriptors that bring A's M rows (M <= 64) into wgmma's 64-row tile as at most two
    boxes of a power of two rows (at least 8): the largest power of two not above M, then the rest
    rounded up. Returns (first, second), second None where one box holds M. A single 64-row box,
    which the TMA fills with zeros past M, slowed the loop markedly for M just past a power of two
    (o at M = 33)."""
    m = a.shape[0]
    first = min(MAX_M, max(8, 1 << (m.bit_length() - 1)))
    boxes = [first] if m <= first else [first, max(8, triton.next_power_of_2(m - first))]
    descs = []
    for rows in boxes:
        layout = gl.NVMMASharedLayout.get_default_for([rows, block_k], gl.float8e4nv)
        descs.append(TensorDescriptor.from_tensor(a, [rows, block_k], layout))
    return descs[0], (descs[1] if len(descs) > 1 else None)


def launch(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out: torch.Tensor,
    cfg: dict,
    scale_block: int,
) -> bool:
    """out = (a * a_scales) @ (w_fp8 * w_scale_inv)^T for M <= 64 on an sm_90 GPU; a and w_fp8
    must suit TMA, out must be row-major. cfg: BLOCK_N (dividing scale_block, at most 128),
    num_stages, whole_tiles_fill (see `plan`); optional boxes (2 or 3: an n-tile of that many
    boxes of BLOCK_N rows, whole n-tiles only, N a multiple of the tile) and direct_max_m (store
    straight from the MMA's registers at M up to it). Returns False, having done nothing, where
    the stream-K tile counters cannot be had (inside a CUDA-graph capture before they exist)."""
    m, k = a.shape
    n = w_fp8.shape[0]
    block_n = cfg["BLOCK_N"]
    boxes = cfg.get("boxes", 1)
    if m > MAX_M or scale_block % block_n or block_n > 128 or out.stride(1) != 1:
        raise ValueError(
            f"gluon decode fp8_gemm config {cfg} at M={m}: needs M <= {MAX_M}, a BLOCK_N that "
            f"divides {scale_block} and is at most 128, and a row-major out"
        )
    w, ctas, max_pieces = plan(n, k, cfg, num_sms(out.device), scale_block)
    if boxes not in (1, 2, 3) or (boxes > 1 and (max_pieces > 1 or n % (boxes * block_n))):
        raise ValueError(
            f"gluon decode fp8_gemm config {cfg} at N={n}, K={k}: boxes must be 1, 2 or 3, and "
            f"more than one needs whole n-tiles of {boxes} x {block_n} rows"
        )
    tiles = triton.cdiv(n, block_n * boxes)
    cnt, part = out, out  # unread without partial sums
    if max_pieces > 1:
        cnt = _splitk.counters(out.device, tiles)
        if cnt is None:
            return False
        part = torch.empty((max_pieces, m, n), dtype=torch.float32, device=out.device)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, scale_block], gl.float8e4nv)
    a_desc, a2_desc = _a_descriptors(a, scale_block)
    b_desc = TensorDescriptor.from_tensor(w_fp8, [block_n, scale_block], b_layout)
    kt = triton.cdiv(k, scale_block)
    pdl = cfg.get("pdl", False) and pdl_enabled(out.device)
    _decode_kernel[(ctas,)](
        a_desc, a2_desc or a_desc, b_desc, a_scales, w_scale_inv, part, out, cnt, m, n, kt, w, tiles * kt,
        a_scales.stride(0), a_scales.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
        part.stride(0), out.stride(0), STAGES=ring_slots(w, cfg), MAX_PIECES=max_pieces,
        TWO_A=a2_desc is not None, PDL=pdl, BOXES=boxes, DIRECT=m <= cfg.get("direct_max_m", 0),
        num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return True
