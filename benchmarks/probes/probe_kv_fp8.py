"""mla_decode, and the decode step's rope with its cache write, on the model's page-major layer views: bf16
rows against fp8 rows (DeepSeek-V3's latent, 128 heads, one query token, 12 layers, 64-token pages).

    python3 benchmarks/probes/probe_kv_fp8.py [B:CTX,...]      (default 1:4096,32:8192,64:4096,128:4096,128:8192)

Prints per shape: each attention's time (a CUDA graph of 5 calls, us a call), whether the Gluon split kernel
ran (its launches counted), the fp8 / bf16 ratio, and the rope + cache write's time (graph of 20)."""

from __future__ import annotations

import sys

import torch
from _common import graph_us

sys.path.insert(0, "benchmarks")
from decode_step import fill_cache  # noqa: E402

from pdserve import kernels
from pdserve.kernels.mla_decode import gluon_sm90
from pdserve.model.kv_cache import FP8, KVCacheLayout, PagedKVCache

LAYERS, PAGE, LORA, ROPE, HEADS = 12, 64, 512, 64, 128

launches = {"gluon": 0}
_launch = gluon_sm90.launch


def _counted(*args, **kwargs):
    launches["gluon"] += 1
    return _launch(*args, **kwargs)


gluon_sm90.launch = _counted


def measure(batch: int, ctx: int, dtype: torch.dtype) -> tuple[float, bool, float]:
    pages_per = ctx // PAGE + 1
    cache = PagedKVCache(KVCacheLayout(LAYERS, PAGE, LORA, ROPE, dtype), batch * pages_per, "cuda")
    fill_cache(cache)
    table = torch.arange(batch * pages_per, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, 1, HEADS, LORA + ROPE, device="cuda", dtype=torch.bfloat16)
    layer = cache.layer(3)
    launches["gluon"] = 0
    attn = graph_us(lambda: kernels.mla_decode(q, layer, table, seq_lens, 0.07, LORA), reps=5)
    gluon = launches["gluon"] > 0
    q_pe = torch.randn(batch, HEADS, 192, device="cuda", dtype=torch.bfloat16)[..., 128:]
    kv = torch.randn(batch, LORA + ROPE, device="cuda", dtype=torch.bfloat16)
    q_out = torch.empty(batch, HEADS, LORA + ROPE, device="cuda", dtype=torch.bfloat16)[..., LORA:]
    positions = torch.full((batch,), ctx - 1, device="cuda")
    cos_sin = torch.randn(8192, ROPE, device="cuda")
    slots = table[:, -1].long() * PAGE
    write = (layer, slots, kv[:, :LORA])
    rope = graph_us(
        lambda: kernels.rope(q_pe, kv[:, LORA:], positions, cos_sin, q_out=q_out, cache=write)
    )
    return attn, gluon, rope


def main() -> None:
    shapes = sys.argv[1] if len(sys.argv) > 1 else "1:4096,32:8192,64:4096,128:4096,128:8192"
    print(torch.cuda.get_device_name())
    print(
        "| batch | context | attention, bf16 rows | fp8 rows | fp8 / bf16 | rope + write, bf16 | fp8 |"
    )
    print("|---|---|---|---|---|---|---|")
    for shape in shapes.split(","):
        batch, ctx = (int(x) for x in shape.split(":"))
        a16, g16, r16 = measure(batch, ctx, torch.bfloat16)
        torch.cuda.empty_cache()
        a8, g8, r8 = measure(batch, ctx, FP8)
        torch.cuda.empty_cache()
        print(
            f"| {batch} | {ctx} | {a16:.1f} (Gluon {g16}) | {a8:.1f} (Gluon {g8}) | {a8 / a16:.2f}x "
            f"| {r16:.1f} | {r8:.1f} |"
        )


if __name__ == "__main__":
    main()
