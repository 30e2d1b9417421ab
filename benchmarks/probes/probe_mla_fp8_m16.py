# ruff: noqa: B023  (closures are timed inside their loop iteration)
"""mla_decode on an fp8 cache at 16 query rows (16 heads): the Triton split kernel's layouts and tiles, with the
latent converted by Triton's casts or by the exact integer conversion (`_kernels.E4M3_TO_BF16_PTX`), against
the bf16 cache's tuned kernel. First each variant's error against the torch reference on a ragged batch, then
the time (`_bench.time_ms`: L2 flushed, median of 50), with the cache bytes read over 4.27 TB/s.
usage: probe_mla_fp8_m16.py [variant,..] (default: all)"""

import sys

sys.path.insert(0, "benchmarks")

import torch
from _bench import HBM_BYTES_PER_S, time_ms
from bench_mla_decode import LORA, ROPE, SCALE, make_inputs

from pdserve.kernels.mla_decode import fp8_format, ref
from pdserve.kernels.mla_decode import triton as tri

HM = {"LAYOUT": "heads_major", "BLOCK_M": 16, "num_stages": 2, "USE_TMA": False}
KM = {
    "LAYOUT": "kv_major",
    "BLOCK_M": 16,
    "BLOCK_N": 64,
    "num_stages": 2,
    "USE_TMA": True,
    "CTAS_PER_SM": 1,
}
VARIANTS = {
    "hm_n32_cast": {**HM, "BLOCK_N": 32, "num_warps": 4, "CTAS_PER_SM": 2, "FP8_ASM": False},
    "hm_n32_asm": {**HM, "BLOCK_N": 32, "num_warps": 4, "CTAS_PER_SM": 2, "FP8_ASM": True},
    "hm_n64_asm": {**HM, "BLOCK_N": 64, "num_warps": 4, "CTAS_PER_SM": 2, "FP8_ASM": True},
    "hm_n64w8_asm": {**HM, "BLOCK_N": 64, "num_warps": 8, "CTAS_PER_SM": 1, "FP8_ASM": True},
    "km_w4_asm": {**KM, "num_warps": 4, "FP8_ASM": True},
    "km_w8_asm": {**KM, "num_warps": 8, "FP8_ASM": True},
    "km_w4_cast": {**KM, "num_warps": 4, "FP8_ASM": False},
}
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


lens = [1, 63, 64, 700, 2049, 3001]
q, cache, pt, sl = make_inputs(len(lens), 16, 1, 3072, 64, True)
sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
want, want_lse = ref.mla_decode(q, cache, pt, sl, SCALE, LORA)
print("| variant | rel err out | max lse err |")
print("|---|---|---|")
for name in names:
    out, lse = tri.mla_decode_launch(q, cache, pt, sl, SCALE, LORA, config=VARIANTS[name])
    print(f"| {name} | {rel(out, want):.2e} | {(lse - want_lse).abs().max().item():.2e} |")

print()
print("| shape | bf16 cache (tuned) | " + " | ".join(names) + " |")
print("|---|---|" + "---|" * len(names))
for batch, seq in ((128, 4096), (128, 8192), (32, 8192), (8, 4096)):
    q16, c16, pt16, sl16 = make_inputs(batch, 16, 1, seq, 64, False)
    t16 = time_ms(lambda: tri.mla_decode(q16, c16, pt16, sl16, SCALE, LORA))
    bf16_bytes = batch * seq * (LORA + ROPE) * 2
    cells = [f"{1e3 * t16:.1f} us, {bf16_bytes / (t16 * 1e-3) / HBM_BYTES_PER_S * 100:.0f}%"]
    q8, c8, pt8, sl8 = make_inputs(batch, 16, 1, seq, 64, True)
    fp8_bytes = batch * seq * fp8_format.row_bytes(LORA, ROPE)
    for name in names:
        t = time_ms(
            lambda: tri.mla_decode_launch(q8, c8, pt8, sl8, SCALE, LORA, config=VARIANTS[name])
        )
        cells.append(f"{1e3 * t:.1f} us, {fp8_bytes / (t * 1e-3) / HBM_BYTES_PER_S * 100:.0f}%")
    print(f"| B{batch} L{seq} | " + " | ".join(cells) + " |")
    torch.cuda.empty_cache()
