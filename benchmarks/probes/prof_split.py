# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""mla_decode's split and combine kernels at forced split counts (bf16 cache, 128 heads, page 64),
torch.profiler over 10 calls, us per call."""

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.kernels.mla_decode import triton as tri

H, L, R, PAGE = 128, 512, 64, 64
for B, ctx, ns in (
    (1, 8192, 64),
    (16, 512, 4),
    (16, 512, 2),
    (64, 512, 1),
    (32, 512, 2),
    (16, 1024, 4),
    (16, 1024, 2),
):
    per = ctx // PAGE
    cache = torch.randn(B * per, PAGE, L + R, device="cuda", dtype=torch.bfloat16)
    pt = torch.randperm(B * per, device="cuda", dtype=torch.int32).view(B, per)
    sl = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(B, 1, H, L + R, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        tri.mla_decode_launch(q, cache, pt, sl, 0.07, L, num_splits=ns)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            tri.mla_decode_launch(q, cache, pt, sl, 0.07, L, num_splits=ns)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, t = rows.get(e.name[:40], (0, 0.0))
            rows[e.name[:40]] = (n + 1, t + e.device_time)
    print(
        f"B={B} ctx={ctx} s{ns}: " + "  ".join(f"{k} {t / 10:.1f}us" for k, (n, t) in rows.items()),
        flush=True,
    )
