# ruff: noqa: E501  (a scratch-style probe)
"""The Gluon decode GEMM (kernels/fp8_gemm/gluon_decode_sm90.py) with launch variants, on the tuned configs of the
shapes: an L2 prefetch of the CTA's whole weight share before the PDL wait (`pf=1`: prefetch.global.L2, `pf=2`:
its evict_last form), fewer registers (`maxnreg=128`: two CTAs an SM fit, one of this call and one of the
next), other tile widths or ring depths (`BLOCK_N=..`, `num_stages=..`, `min_stages=..`), the SM count of the plan
(`sms=..`). The variant kernel is the module's source patched at run time (so it follows the kept kernel).
Graph of 8 calls on 8 distinct weights, fp8 input, per call, us, % of 4.27 TB/s on the weight bytes; MISMATCH
where the bits differ from the first variant's (a different plan sums in another order).
usage: probe_gd_variants.py SHAPE[,..] M[,..] "name:key=v,..;name:..."    e.g. qkv_a 16,64 "base:;pf:pf=1" """

import functools
import importlib.util
import inspect
import sys

import torch

sys.path.insert(0, "benchmarks")
from _bench import HBM_BYTES_PER_S, time_graph_ms  # noqa: E402
from bench_fp8_gemm import DECODE_SHAPES, _weight  # noqa: E402

from pdserve.kernels.fp8_gemm import gluon_decode_sm90  # noqa: E402
from pdserve.kernels.fp8_gemm import triton as tri  # noqa: E402

PATCHES = [
    ("from .._backend import", "from pdserve.kernels._backend import"),
    ("from . import _splitk", "from pdserve.kernels.fp8_gemm import _splitk"),
    ("from .gluon_sm90 import", "from pdserve.kernels.fp8_gemm.gluon_sm90 import"),
    (
        """                  STAGES: gl.constexpr, BOXES: gl.constexpr, TWO_A: gl.constexpr,
                  PDL: gl.constexpr):  # fmt: skip""",
        """                  STAGES: gl.constexpr, BOXES: gl.constexpr, TWO_A: gl.constexpr,
                  PDL: gl.constexpr, w_ptr, stride_wn, N, PF: gl.constexpr):  # fmt: skip""",
    ),
    (
        """                _load_b(b_desc, ready.index(g - start), b_bufs, g - start, g, KT, A_BYTES, BOXES)
            gdc_wait()""",
        """                _load_b(b_desc, ready.index(g - start), b_bufs, g - start, g, KT, A_BYTES, BOXES)
            if PF:
                pfl: gl.constexpr = gl.BlockedLayout([max(BLOCK_N // 32, 1)], [32], [1], [0])
                r = gl.arange(0, BLOCK_N, layout=pfl)
                for g in range(start + STAGES, end):
                    for j in gl.static_range(BOXES):
                        rows = gl.minimum((g // KT) * (BOXES * BLOCK_N) + j * BLOCK_N + r, N - 1).to(gl.int64)
                        ptrs = w_ptr + rows * stride_wn + (g % KT) * BLOCK_K
                        if PF == 1:
                            gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1)
                        else:
                            gl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1)
            gdc_wait()""",
    ),
    (
        """        BOXES: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip""",
        """        BOXES: gl.constexpr, DIRECT: gl.constexpr, w_ptr, stride_wn, PF: gl.constexpr,
    ):  # fmt: skip""",
    ),
    (
        "                     STAGES, BOXES, TWO_A, PDL),",
        "                     STAGES, BOXES, TWO_A, PDL, w_ptr, stride_wn, N, PF),",
    ),
    (
        "plan(n, k, cfg, num_sms(out.device), scale_block)",
        'plan(n, k, cfg, cfg.get("sms") or num_sms(out.device), scale_block)',
    ),
    (
        "STAGES=ring_slots(w, cfg), MAX_PIECES=max_pieces,",
        'STAGES=ring_slots(w, cfg), MAX_PIECES=max_pieces, w_ptr=w_fp8, stride_wn=w_fp8.stride(0), PF=cfg.get("pf", 0), '
        '**({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),',
    ),
]


def variant_module():
    src = inspect.getsource(gluon_decode_sm90)
    for old, new in PATCHES:
        if old not in src:
            raise SystemExit(
                f"probe_gd_variants: the kernel's source changed; patch not applied: {old[:60]!r}"
            )
        src = src.replace(old, new)
    # gluon.jit reads the source of its functions: give the module a file of its own
    path = "/tmp/gd_variant.py"
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("gd_variant", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    gd_mod = variant_module()
    shapes, ms = sys.argv[1].split(","), [int(x) for x in sys.argv[2].split(",")]
    variants = {}
    for spec in sys.argv[3].split(";"):
        name, _, kv = spec.partition(":")
        variants[name] = {
            k: int(v) for k, v in (item.split("=") for item in filter(None, kv.split(",")))
        }
    print("| shape | M | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for name in shapes:
        k, n = DECODE_SHAPES[name]
        weights = [_weight(n, k) for _ in range(8)]
        wbytes = n * k + weights[0][1].numel() * 4
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_fp8, x_s = tri._quantize(x, 128, scale_column_major=True)
            gd = tri._gluon_decode(tri._gemm_config(m, n, k, x.device), m, k, x.device)
            if gd is None:
                print(f"| {name} | {m} | not on the Gluon decode kernel |")
                continue
            cells, first = [], None
            for v in variants.values():
                cfg = {**gd, **v}
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
                calls = [functools.partial(gd_mod.launch, x_fp8, x_s, w, s, o, cfg, 128)
                         for (w, s), o in zip(weights, outs, strict=True)]  # fmt: skip

                def run(calls=calls):
                    for c in calls:
                        c()

                try:
                    run()
                    torch.cuda.synchronize()
                except Exception as err:  # noqa: BLE001  (a variant the kernel cannot take)
                    cells.append(f"n/a ({type(err).__name__})")
                    continue
                first = first or [o.clone() for o in outs]
                same = all(torch.equal(a, b) for a, b in zip(outs, first, strict=True))
                us = min(time_graph_ms(run) for _ in range(3)) / 8 * 1e3
                frac = wbytes / us * 1e6 / HBM_BYTES_PER_S
                cells.append(f"{us:.2f} ({frac:.0%}){'' if same else ' MISMATCH'}")
            print(f"| {name} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
