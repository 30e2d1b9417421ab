"""The shared expert stored as one more slot of the stacked routed experts (`MoE.fused_shared` in deepseek.py):
whether a layer's shared expert can be, how its MLP's weights become views of that slot, and up to how many tokens
the fused form runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from .args import QUANT_BLOCK, ModelArgs

if TYPE_CHECKING:
    from .deepseek import MLP, Experts

FUSED_SHARED_MAX_TOKENS = 16
"""Up to this many tokens, a fused shared expert runs as one more expert of the routed experts' launch: at
decode sizes that saves its own GEMM launches; past this, the one launch's extra rows cost more than they
save."""


def can_fuse_shared(args: ModelArgs, shared: MLP, experts_fp8: bool) -> bool:
    """Whether the shared expert has a routed expert's layout: one expert of moe_intermediate_size, its w13
    gate rows then up rows with no gap, the same weight format, whole 128x128 scale blocks when fp8."""
    d, i = args.hidden_size, args.moe_intermediate_size
    same_format = shared.w13.is_fp8 == shared.w2.is_fp8 == experts_fp8
    whole_blocks = not experts_fp8 or (d % QUANT_BLOCK == 0 and i % QUANT_BLOCK == 0)
    return (
        args.n_shared_experts == 1 and same_format and whole_blocks
        and shared.w13.offsets == (0, i)
    )  # fmt: skip


def alias_slot(mlp: MLP, experts: Experts, slot: int) -> None:
    """Points the MLP's weights (and scales) at expert `slot` of the stacked experts: one copy in memory, filled
    through either name by the loader."""
    for linear, w, scale in (
        (mlp.w13, experts.w13, experts.w13_scale_inv),
        (mlp.w2, experts.w2, experts.w2_scale_inv),
    ):
        assert linear.weight.shape == w.shape[1:] and linear.weight.dtype == w.dtype
        linear.weight = nn.Parameter(w.data[slot], requires_grad=False)
        if scale is not None:
            assert linear.weight_scale_inv.shape == scale.shape[1:]
            linear.weight_scale_inv = nn.Parameter(scale.data[slot], requires_grad=False)
