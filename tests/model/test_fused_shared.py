"""The shared expert stored as slot E of the stacked experts (`MoE.fused_shared`): one copy of its weights, filled
from the checkpoint's shared-expert tensors; small batches run it inside the routed experts' launch, larger ones
and batch-invariant mode as its own MLP over the same weights, with the same result."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from pdserve import kernels
from pdserve.model import deepseek
from pdserve.model.args import ModelArgs
from pdserve.model.deepseek import FUSED_SHARED_MAX_TOKENS, MoE, no_fp8
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import preset_config


def _stored(path, name: str) -> torch.Tensor:
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                return f.get_tensor(name)
    raise KeyError(name)


@pytest.mark.parametrize("variant", ["tiny-fp32", "tiny-fp8"])
def test_shared_expert_is_the_last_expert_slot(checkpoint, variant):
    path = checkpoint(variant)
    model = load_model(path, dtype=torch.float32)
    args = model.args
    e, i = args.n_routed_experts, args.moe_intermediate_size
    layer = args.first_k_dense_replace
    moe = model.layers[layer].ffn
    assert moe.fused_shared and moe.experts.w13.shape[0] == e + 1
    shared = moe.shared_experts
    assert shared.w13.weight.data_ptr() == moe.experts.w13[e].data_ptr()
    assert shared.w2.weight.data_ptr() == moe.experts.w2[e].data_ptr()
    p = f"model.layers.{layer}.mlp.shared_experts"
    assert torch.equal(moe.experts.w13[e, :i], _stored(path, f"{p}.gate_proj.weight"))
    assert torch.equal(moe.experts.w13[e, i:], _stored(path, f"{p}.up_proj.weight"))
    assert torch.equal(moe.experts.w2[e], _stored(path, f"{p}.down_proj.weight"))
    if variant == "tiny-fp8":
        assert moe.experts.w13_scale_inv[e].data_ptr() == shared.w13.weight_scale_inv.data_ptr()
        want = _stored(path, f"{p}.down_proj.weight_scale_inv")
        assert torch.equal(moe.experts.w2_scale_inv[e], want)


def _spy_top_k(monkeypatch) -> list[int]:
    """Records the number of experts a token takes in each fused_moe call."""
    seen, real = [], kernels.fused_moe

    def spy(x, w13, w2, weights, ids, *rest):
        seen.append(ids.shape[1])
        return real(x, w13, w2, weights, ids, *rest)

    monkeypatch.setattr(kernels, "fused_moe", spy)
    return seen


@pytest.mark.parametrize(
    ("variant", "device", "dtype", "tol"),
    [
        ("tiny-fp32", "cpu", torch.float32, 1e-6),
        ("tiny-fp8", "cpu", torch.float32, 1e-6),
        pytest.param("tiny-bf16", "cuda", torch.bfloat16, 1e-2, marks=pytest.mark.gpu),
        pytest.param("tiny-fp8", "cuda", torch.bfloat16, 3e-2, marks=pytest.mark.gpu),
    ],
)  # fmt: skip
def test_fused_and_separate_shared_expert_agree(
    checkpoint, monkeypatch, variant, device, dtype, tol
):
    """Below the threshold the shared expert is one more column of the routing (k + 1 experts a token); above it
    and in batch-invariant mode it runs apart (k). Both give the routed experts' sum plus the shared MLP's output:
    the references alike to fp32 rounding; the Triton kernels within bf16 rounding, and for fp8 within the
    activation's requantization, which differs between one launch and the MLP's two GEMMs (DeepSeek-V3 shapes
    on an H200: 1.4e-2 relative)."""
    model = load_model(checkpoint(variant), device, dtype)
    moe = model.layers[model.args.first_k_dense_replace].ffn
    k = model.args.num_experts_per_tok
    seen = _spy_top_k(monkeypatch)
    for tokens in (1, FUSED_SHARED_MAX_TOKENS, FUSED_SHARED_MAX_TOKENS + 1):
        x = torch.randn(
            tokens, model.args.hidden_size, generator=torch.Generator().manual_seed(tokens)
        )
        x = x.to(device, dtype)
        weights, ids = moe.gate(x)
        want = moe.experts(x, weights, ids) + moe.shared_experts(x)
        seen.clear()
        got = moe(x)
        assert seen == [k + 1 if tokens <= FUSED_SHARED_MAX_TOKENS else k]
        assert (got - want).float().norm() / want.float().norm() < tol, tokens
        with kernels.use_batch_invariant():
            seen.clear()
            apart = moe(x)
            assert seen == [k]
            assert (apart - want).float().norm() / want.float().norm() < tol, tokens


def test_shared_expert_stays_apart_when_its_layout_differs():
    """Two shared experts (one MLP twice as wide), or a shared expert in another weight format than the routed
    ones, keep their own weights."""
    config = preset_config("tiny", dtype="fp32")
    two = ModelArgs.from_dict({**config, "n_shared_experts": 2})
    with torch.device("meta"):
        moe = MoE(two, torch.float32, no_fp8, "layers.1.ffn")
        assert not moe.fused_shared
        assert moe.experts.w13.shape[0] == two.n_routed_experts
        one = ModelArgs.from_dict(config)
        only_routed = MoE(one, torch.float32, lambda p: p.endswith(".experts"), "layers.1.ffn")
        assert not only_routed.fused_shared
        assert deepseek.MoE(one, torch.float32, no_fp8, "layers.1.ffn").fused_shared
