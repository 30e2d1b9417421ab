# ruff: noqa: B023, E501  (scratch-style probes: closures are timed inside their loop iteration)
"""Absorbed-MLA query assembly: einsum + cat against bmm into a [T, H, 576] buffer + copy of q_pe; and the
router's upcast + fp32 GEMV. CUDA graph of 20 repeats, median of 20 replays, us per repeat."""

import torch
from _common import graph_us

H, NOPE, ROPE, LAT, D, E = 128, 128, 64, 512, 7168, 256
REPS = 20


def timed(fn):
    return graph_us(fn, REPS, replays=20)


for T in ():
    q = torch.randn(T, H, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
    q_nope, q_pe = q.split([NOPE, ROPE], -1)
    w_uk = torch.randn(H, NOPE, LAT, device="cuda", dtype=torch.bfloat16)
    buf = torch.empty(T, H, LAT + ROPE, device="cuda", dtype=torch.bfloat16)
    lat = torch.einsum("thk,hkn->thn", q_nope, w_uk)

    def a():
        ql = torch.einsum("thk,hkn->thn", q_nope, w_uk)
        return torch.cat([ql, q_pe], -1)

    def einsum_only():
        return torch.einsum("thk,hkn->thn", q_nope, w_uk)

    def cat_only():
        return torch.cat([lat, q_pe], -1)

    def b():
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=buf[..., :LAT].transpose(0, 1))
        buf[..., LAT:].copy_(q_pe)
        return buf

    def bmm_only():
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=buf[..., :LAT].transpose(0, 1))

    ra, rb = a(), b()
    same = torch.equal(ra, rb)
    ptr_ok = True
    before = buf.data_ptr()
    b()
    ptr_ok = buf.data_ptr() == before
    print(
        f"T={T:4d} einsum+cat {timed(a):7.1f}  einsum {timed(einsum_only):6.1f}  cat {timed(cat_only):6.1f}  "
        f"| bmm-out+copy {timed(b):7.1f}  bmm-out {timed(bmm_only):6.1f}  same bits {same} in place {ptr_ok}",
        flush=True,
    )

for T in ():
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, D, device="cuda", dtype=torch.float32)
    xf = x.float()

    def gate():
        return torch.nn.functional.linear(x.float(), w)

    def gemv_only():
        return torch.nn.functional.linear(xf, w)

    print(
        f"T={T:4d} gate upcast+fp32 linear {timed(gate):6.1f}  fp32 linear alone {timed(gemv_only):6.1f}",
        flush=True,
    )

for T in (1, 16, 64, 128, 512):
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    wb = (torch.randn(E, D, device="cuda") / D**0.5).to(torch.bfloat16)
    w = wb.float()
    ref = torch.nn.functional.linear(x.double(), w.double())
    cur = torch.nn.functional.linear(x.float(), w)
    new = torch.mm(x, wb.t(), out_dtype=torch.float32)

    def gate():
        return torch.nn.functional.linear(x.float(), w)

    def mm_out32():
        return torch.mm(x, wb.t(), out_dtype=torch.float32)

    def lin_bf16():
        return torch.nn.functional.linear(x, wb)

    e_cur = ((cur.double() - ref).abs().max() / ref.abs().max()).item()
    e_new = ((new.double() - ref).abs().max() / ref.abs().max()).item()
    print(
        f"T={T:4d} upcast+fp32 {timed(gate):6.1f}  mm bf16->fp32 {timed(mm_out32):6.1f}  linear bf16 {timed(lin_bf16):6.1f}"
        f"  max err/max: fp32 {e_cur:.1e} bf16-in {e_new:.1e}",
        flush=True,
    )
