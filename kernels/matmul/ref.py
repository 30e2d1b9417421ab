"""Dense matmuls of the model, in plain torch (cuBLAS on a GPU): the spec of the Triton kernels.

`linear(x, w)`: x [..., K] @ w[N, K]^T -> [..., N] in x's dtype (w must have x's dtype).
`head_matmul(x, w)`: per head h, x[:, h] @ w[h]: x [T, H, K], w [H, K, N] (any strides) -> [T, H, N].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("thk,hkn->thn", x, w)
