"""Sweep launch configs for fp8_gemm and fused_moe on one GPU; print each candidate's time and the
compiled kernels' registers, spills and MMA instructions. Candidates are installed through
`tuning.register` for this process only; copy the winners into kernels/tuning.py by hand.

    python benchmarks/tune_moe_fp8.py [--groups a,b] [--compile-only --part i/n]

`--compile-only --part i/n` runs every n-th candidate once (filling Triton's on-disk cache), so
several processes can compile in parallel before one process times everything.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import time_graph_ms, time_ms  # noqa: E402
from bench_fused_moe import EXPERTS, HIDDEN, INTER, TOP_K, _fp8, routing  # noqa: E402

from pdserve.kernels import fp8_quant_triton, tuning  # noqa: E402
from pdserve.kernels.fp8_gemm import ref as gemm_ref  # noqa: E402
from pdserve.kernels.fp8_gemm import triton as gemm  # noqa: E402
from pdserve.kernels.fused_moe import triton as moe  # noqa: E402


def _g(bm, bn, w, s, gm=8, fuse=False, split=0, min_k=4):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "GROUP_M": gm,
            "fuse_quant": fuse, "split_k_target_ctas": split, "min_k_tiles": min_k}  # fmt: skip


def _m(bm, n1, k1, w1, s1, n2, k2, w2, s2, gm=8):
    return {"BLOCK_M": bm, "GROUP_M": gm, "BLOCK_N1": n1, "BLOCK_K1": k1, "warps1": w1,
            "stages1": s1, "BLOCK_N2": n2, "BLOCK_K2": k2, "warps2": w2, "stages2": s2}  # fmt: skip


def _t(cfg, **extra):
    return {**cfg, **extra}


GEMM_LARGE = [
    _t(_g(128, 128, 8, 4, gm=16), tma=True), _t(_g(128, 128, 8, 5, gm=16), tma=True),
    _t(_g(128, 128, 8, 4, gm=8), tma=True), _t(_g(64, 128, 4, 4, gm=16), tma=True),
    _t(_g(64, 128, 4, 3, gm=16), tma=True), _t(_g(128, 64, 4, 4, gm=16), tma=True),
    # four warpgroups over a 256-row or 256-column tile: 64 accumulator registers a thread, as at
    # 128x128 with 8 warps, but twice the MMA work per byte of shared memory read
    *[_t(_g(bm, bn, 16, s, gm=16), tma=True) for bm, bn in ((256, 128), (128, 256)) for s in (3, 4)],
    _t(_g(128, 256, 8, 3, gm=16), tma=True),
]  # fmt: skip
GEMM_DECODE = [
    _g(64, 64, 4, 4, split=264), _g(64, 64, 4, 4, split=264, min_k=2), _g(64, 64, 4, 5, split=264),
    _g(64, 128, 4, 4, split=264, min_k=2), _g(64, 128, 8, 4, split=264),
    _g(64, 128, 8, 4, fuse=True, split=264), _g(64, 64, 4, 4, fuse=True, split=264),
]  # fmt: skip
GEMM_DECODE1 = [
    _t(_g(16, 128, 4, 3, fuse=True, split=396), swap_ab=True, one_wave=True),
    _t(_g(16, 128, 4, 3, fuse=True, split=264), swap_ab=True),
    *[_t(_g(16, 128, 4, s, fuse=True, split=132), swap_ab=True, one_wave=True) for s in (8, 10)],
    *[_t(_g(16, 128, 4, s, fuse=True, split=264), swap_ab=True, one_wave=True) for s in (5,)],
    *[_t(_g(16, 128, 4, s, split=132), swap_ab=True, one_wave=True) for s in (8, 10)],
    *[_t(_g(16, 128, 8, s, fuse=True, split=132), swap_ab=True, one_wave=True) for s in (8,)],
]  # fmt: skip
GEMV = [
    {"gemv": True, "max_m": 4, "fuse_quant": True, "BLOCK_N": bn, "GROUPS": g, "num_warps": w,
     "num_stages": 1, "split_k_target_ctas": split, "min_k_tiles": 4, "prefetch": pre}
    for bn, g, w, split, pre in (
        (16, 4, 4, 528, False), (16, 2, 2, 1056, False), (16, 4, 4, 528, True),
        (16, 4, 4, 1056, True), (16, 2, 2, 1056, True), (16, 2, 4, 1056, True),
        (8, 4, 2, 1056, True), (32, 2, 4, 528, True), (16, 8, 4, 528, True),
        (8, 8, 4, 1056, True), (8, 2, 1, 2112, True),
    )
] + [_t(_g(16, 128, 4, 3, fuse=True, split=396), swap_ab=True, one_wave=True)]  # fmt: skip
DECODE_SHAPES = (
    (1536, 24576),
    (16384, 7168),
    (7168, 576),
    (7168, 18432),
    (18432, 7168),
    (7168, 1536),
)
MOE_BF16_BIG = [
    _m(128, 128, 64, 8, 3, 256, 64, 8, 3),
    _t(_m(128, 128, 64, 8, 3, 256, 64, 8, 3), permute_a=True),
    _t(_m(128, 128, 64, 8, 3, 256, 64, 8, 3), permute_a=True, tma=True),
    _t(_m(128, 128, 64, 8, 4, 256, 64, 8, 3), permute_a=True),
]  # fmt: skip
_FP8_PREFILL = _t(_m(128, 128, 128, 8, 3, 128, 128, 8, 4), tma=True, permute_a=True)
MOE_FP8_BIG = [_FP8_PREFILL, _t(_FP8_PREFILL, tma_act=True)]
MOE_BF16_DECODE = [
    _m(32, 64, 128, 4, 4, 64, 128, 4, 4), _m(32, 64, 128, 4, 5, 64, 128, 4, 6),
    _m(32, 128, 64, 4, 6, 128, 64, 4, 6), _t(_m(32, 64, 128, 4, 4, 64, 128, 4, 4), tma=True),
    _m(64, 64, 128, 4, 4, 64, 128, 4, 4),
]  # fmt: skip
MOE_FP8_DECODE = [
    _m(32, 128, 128, 4, 4, 128, 128, 4, 4), _m(32, 128, 128, 4, 5, 64, 128, 4, 6),
    _t(_m(32, 128, 128, 4, 4, 128, 128, 4, 4), tma=True), _m(64, 128, 128, 4, 4, 128, 128, 4, 4),
]  # fmt: skip


def _gemm_case(m: int, k: int, n: int):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_fp8, w_s = gemm_ref.quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
    return x, w_fp8, w_s


_MOE = {}


def _moe_inputs(num_tokens: int):
    if "w" not in _MOE:
        g = torch.Generator(device="cuda").manual_seed(1)
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5
        w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g) / INTER**0.5
        _MOE["fp8"] = (*_fp8(w13), *_fp8(w2))
        _MOE["w"] = (w13.bfloat16(), w2.bfloat16())
    weights, ids = routing(num_tokens, "balanced")
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return x, weights, ids


def _jobs(groups: set[str]):
    """(group, label, op, key, cfg, fn, work) with work = flops or bytes for the rate column."""
    jobs = []
    if "gemm_large" in groups:
        x, w, s = _gemm_case(8192, 8192, 8192)
        xq, xs = fp8_quant_triton.quantize_rows(x, 128, scale_column_major=True)
        for cfg in GEMM_LARGE:
            jobs.append(("gemm_large", str(cfg), "fp8_gemm", "m>128", cfg,
                         lambda xq=xq, xs=xs, w=w, s=s: gemm.scaled_gemm(xq, xs, w, s),
                         ("TFLOP/s", 2 * 8192**3)))  # fmt: skip
    for group, m, key, cands in (
        ("gemm_decode", 64, "m<=64", GEMM_DECODE), ("gemm_decode1", 1, "m<=16", GEMM_DECODE1),
        ("gemv1", 1, "m<=1", GEMV), ("gemv2", 2, "m<=16", GEMV), ("gemv4", 4, "m<=16", GEMV),
    ):  # fmt: skip
        if group not in groups:
            continue
        for k, n in DECODE_SHAPES:
            x, w, s = _gemm_case(m, k, n)
            for cfg in cands:
                fn = lambda x=x, w=w, s=s: gemm.fp8_gemm(x, w, s)  # noqa: E731
                jobs.append((f"{group} {k}->{n}", str(cfg), "fp8_gemm", key, cfg, fn,
                             ("GB/s", n * k)))  # fmt: skip
    for group, tokens, key, cands, fp8 in (
        ("moe_bf16_big", 4096, "bf16,rows>256", MOE_BF16_BIG, False),
        ("moe_fp8_big", 4096, "fp8,rows>256", MOE_FP8_BIG, True),
        ("moe_bf16_decode", 64, "bf16,rows<=16", MOE_BF16_DECODE, False),
        ("moe_fp8_decode", 64, "fp8,rows<=16", MOE_FP8_DECODE, True),
    ):
        if group not in groups:
            continue
        x, weights, ids = _moe_inputs(tokens)
        touched = int(torch.unique(ids).numel())
        work = (("TFLOP/s", 6 * tokens * TOP_K * HIDDEN * INTER) if tokens > 1024
                else ("GB/s", touched * 3 * HIDDEN * INTER * (1 if fp8 else 2)))  # fmt: skip
        weight_args = _MOE["fp8"] if fp8 else _MOE["w"]

        def fn(x=x, wt=weights, i=ids, w=weight_args, fp8=fp8):
            if fp8:
                return moe.fused_moe(x, w[0], w[2], wt, i, w[1], w[3])
            return moe.fused_moe(x, w[0], w[1], wt, i)

        for cfg in cands:
            jobs.append((group, str(cfg), "fused_moe", key, cfg, fn, work))
    return jobs


def _kernel_report(fn) -> list[str]:
    """Registers, spills and MMA flavour of every compiled variant of a @triton.jit function."""
    try:
        return _kernel_lines(fn)
    except (AttributeError, KeyError, TypeError) as err:  # Triton internals differ by version
        return [f"  {fn}: no report ({err!r})"]


def _sass_mma(compiled) -> str:
    """Counts of Hopper MMA instructions in the cubin's SASS (cuobjdump from the CUDA toolkit)."""
    cubin = compiled.asm.get("cubin")
    tool = shutil.which("cuobjdump")
    if not cubin or not tool:
        return "n/a"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True).stdout
    counts = {op: sass.count(op) for op in ("QGMMA", "HGMMA", "HMMA", "LDL", "STL")}
    return ",".join(f"{op}:{n}" for op, n in counts.items() if n)


def _kernel_lines(fn) -> list[str]:
    lines = []
    for cache in getattr(fn, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for compiled in getattr(kernels, "values", lambda: [])():
            ptx = compiled.asm.get("ptx", "")
            mma = ("wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx
                   else "none") + ("/e4m3" if "e4m3" in ptx and "wgmma" in ptx else "")  # fmt: skip
            c = compiled.metadata
            lines.append(f"  {fn.__name__}: warps={c.num_warps} stages={c.num_stages} "
                         f"regs={compiled.n_regs} spills={compiled.n_spills} "
                         f"smem={c.shared} mma={mma} sass={_sass_mma(compiled)}")  # fmt: skip
    return lines


def _profile() -> None:
    """Per-kernel CUDA time of fused_moe (4096 tokens, bf16 and fp8) with the registered table."""
    from torch.profiler import ProfilerActivity, profile

    x, weights, ids = _moe_inputs(4096)
    w13, w2 = _MOE["w"]
    w13q, w13s, w2q, w2s = _MOE["fp8"]
    for name, fn in (
        ("bf16", lambda: moe.fused_moe(x, w13, w2, weights, ids)),
        ("fp8", lambda: moe.fused_moe(x, w13q, w2q, weights, ids, w13s, w2s)),
    ):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"fused_moe {name}, 4096 tokens, 5 calls:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def _print_totals(totals: dict[str, dict[str, list[float]]]) -> None:
    """For groups swept over several shapes: each candidate's summed time, best first (a tuning key holds
    one config for all the shapes of its class)."""
    for group, by_label in totals.items():
        full = max(len(t) for t in by_label.values())
        if full < 2:
            continue
        ranked = sorted((sum(t), label) for label, t in by_label.items() if len(t) == full)
        print(f"\n{group}: summed over {full} shapes, best 5")
        for total, label in ranked[:5]:
            print(f"  {total:8.4f} ms  {label}")


def main() -> None:
    all_groups = "gemm_large,gemm_decode,moe_bf16_big,moe_fp8_big,moe_bf16_decode,moe_fp8_decode"
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", default=all_groups)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--part", default="0/1")
    parser.add_argument("--profile", action="store_true", help="per-kernel times, tuned table")
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays")
    args = parser.parse_args()
    if args.profile:
        _profile()
        return
    part, parts = map(int, args.part.split("/"))
    jobs = _jobs(set(args.groups.split(",")))
    best: dict[str, tuple[float, str]] = {}
    totals: dict[str, dict[str, list[float]]] = {}
    for index, (group, label, op, key, cfg, fn, (unit, work)) in enumerate(jobs):
        if args.compile_only and index % parts != part:
            continue
        tuning.register(op, "sm90", {key: cfg, "default": cfg})
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - a sweep reports a failing candidate and goes on
            print(f"{group:28s} FAILED {label}: {type(err).__name__}: {str(err)[:200]}", flush=True)
            continue
        if args.compile_only:
            continue
        ms = (time_graph_ms if args.graph else time_ms)(fn, warmup=3, iters=15)
        rate = work / ms / 1e9 if unit == "TFLOP/s" else work / ms / 1e6
        print(f"{group:28s} {ms:8.4f} ms {rate:7.0f} {unit}  {label}", flush=True)
        if group not in best or ms < best[group][0]:
            best[group] = (ms, label)
        totals.setdefault(group.split()[0], {}).setdefault(label, []).append(ms)
    if args.compile_only:
        return
    _print_totals(totals)
    print("\nbest per group:")
    for group, (ms, label) in best.items():
        print(f"  {group:28s} {ms:8.4f} ms  {label}")
    print("\ncompiled kernels:")
    for fn in (gemm._fp8_gemm_kernel, fp8_quant_triton._quantize_act_kernel,
               gemm.gemv._fp8_gemv_kernel, moe._gate_up_kernel, moe._down_kernel):  # fmt: skip
        for line in _kernel_report(fn):
            print(line)


if __name__ == "__main__":
    main()
