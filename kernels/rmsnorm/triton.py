"""RMSNorm (+ fused residual add) in Triton: same contract and rounding order as `ref.rmsnorm`.

One program normalises ROWS rows of D values. With a residual, the sum x + residual is formed in
fp32 and rounded to the residual's dtype (x's, or fp32 for an fp32 residual stream), written out as
the new residual, and normalised in fp32. The normalised value is rounded to x's dtype before the weight multiply, which
is done in fp32 and rounded again, exactly as `weight * h.to(x.dtype)` does in torch. Any leading
shape is accepted; rows may have any stride, the last dim must be contiguous (it is for every caller
in the model).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import tuning

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

tuning.register(
    "rmsnorm",
    "any",
    {
        # key: "d=<next pow2 of D>"; ROWS rows per program.
        "default": {"ROWS": 1, "num_warps": 4},
        "d=512": {"ROWS": 4, "num_warps": 4},
        "d=1024": {"ROWS": 2, "num_warps": 4},
        "d=2048": {"ROWS": 1, "num_warps": 4},
        "d=8192": {"ROWS": 1, "num_warps": 8},
    },
)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    num_rows, dim, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    for i in tl.static_range(ROWS):
        row = pid * ROWS + i
        if row < num_rows:
            row64 = row.to(tl.int64)
            x = tl.load(x_ptr + row64 * stride_x + offs_d, mask=mask_d, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row64 * stride_res + offs_d, mask=mask_d, other=0.0)
                s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
                tl.store(res_out_ptr + row64 * stride_res_out + offs_d, s, mask=mask_d)
                h = s.to(tl.float32)
            else:
                h = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / dim + eps)
            h = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
            out = (w * h).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row64 * stride_out + offs_d, out, mask=mask_d)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., D]; weight: [D]. Returns out (x's dtype and shape), or (out, x +
    residual)."""
    if x.dim() < 1 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"rmsnorm: x must be a float tensor [..., D], got {x.dtype} {tuple(x.shape)}"
        )
    dim = x.shape[-1]
    if weight.shape != (dim,) or weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"rmsnorm: weight must be [{dim}] float, got {weight.dtype} {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"rmsnorm: weight on {weight.device}, x on {x.device}")
    if residual is not None and (
        residual.shape != x.shape
        or residual.dtype not in (x.dtype, torch.float32)
        or residual.device != x.device
    ):
        raise ValueError(
            f"rmsnorm: residual must match x ({x.dtype} or float32, {tuple(x.shape)} on {x.device}), "
            f"got {residual.dtype} {tuple(residual.shape)} on {residual.device}"
        )
    x2 = _rows(x)  # [N, D]
    res2 = _rows(residual) if residual is not None else x2
    weight = weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(out, dtype=residual.dtype) if residual is not None else out
    out2, res_out2 = out.view(-1, dim), res_out.view(-1, dim)
    num_rows = x2.shape[0]
    if num_rows == 0 or dim == 0:
        return out if residual is None else (out, res_out)
    block_d = triton.next_power_of_2(dim)
    cfg = tuning.lookup("rmsnorm", f"d={block_d}", x.device)
    rows = cfg["ROWS"]
    _rmsnorm_kernel[(triton.cdiv(num_rows, rows),)](
        x2, res2, weight, out2, res_out2,
        num_rows, dim, eps,
        x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_D=block_d, ROWS=rows, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out if residual is None else (out, res_out)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] as [N, D] with unit stride along D (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
