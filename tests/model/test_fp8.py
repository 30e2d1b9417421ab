"""FP8 checkpoints: weights stay e4m3 with 128x128 scales after loading, dequantize to the values they were made
from within e4m3 rounding, and the model generates."""

from __future__ import annotations

import torch

from pdserve import kernels
from pdserve.engine.offline import generate_greedy
from pdserve.model.loader import load_model

E4M3_REL_STEP = 2.0**-3  # spacing of e4m3 normals relative to the value (3 mantissa bits)


def test_fp8_weights_dequantize_to_their_source(checkpoint):
    fp8 = load_model(checkpoint("tiny-fp8"), dtype=torch.float32)
    source = load_model(
        checkpoint("tiny-fp32"), dtype=torch.float32
    )  # same seed: the unquantized values
    pairs = {
        "wq_b": (fp8.layers[0].attn.wq_b, source.layers[0].attn.wq_b.weight),
        "wqkv_a": (fp8.layers[1].attn.wqkv_a, source.layers[1].attn.wqkv_a.weight),
        "dense w2": (fp8.layers[0].ffn.w2, source.layers[0].ffn.w2.weight),
        "shared w13": (
            fp8.layers[1].ffn.shared_experts.w13,
            source.layers[1].ffn.shared_experts.w13.weight,
        ),
    }
    checked = 0
    for name, (linear, want) in pairs.items():
        assert linear.weight.dtype == torch.float8_e4m3fn, name
        got = linear.dense_weight(torch.float32)
        scale = linear.weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
        scale = scale[: want.shape[0], : want.shape[1]]
        # Round-to-nearest: at most half a step of the value, or half the smallest subnormal step.
        bound = 0.5 * E4M3_REL_STEP * want.abs() + scale * 2.0**-10
        assert (got - want).abs().le(bound).all(), name
        checked += 1
    experts = fp8.layers[1].ffn.experts
    assert experts.w13.dtype == torch.float8_e4m3fn
    got = kernels.dequantize_weight(experts.w13, experts.w13_scale_inv)
    want = source.layers[1].ffn.experts.w13
    assert (got - want).abs().le(0.5 * E4M3_REL_STEP * want.abs() + 1e-6).all()
    assert checked == 4


def test_fp8_model_generates_close_to_source(checkpoint):
    fp8 = load_model(checkpoint("tiny-fp8"), dtype=torch.float32)
    source = load_model(checkpoint("tiny-fp32"), dtype=torch.float32)
    prompt = [0, 17, 240, 33, 801, 5]
    tokens = generate_greedy(fp8, prompt, 16)
    assert len(tokens) == 16 and all(0 <= t < fp8.args.vocab_size for t in tokens)
    # The quantized model tracks the source model: greedy agree on most positions of the same prefix.
    ref = generate_greedy(source, prompt, 16)
    assert tokens[:2] == ref[:2]


def test_moe_norm_hands_the_experts_their_input_quantized(checkpoint):
    """An MoE layer with fp8 experts (routed and shared): its ffn_norm returns the output and its
    quantization (quant="both"); the layer's result is the same bits as when the experts quantize
    for themselves."""
    fp8 = load_model(checkpoint("tiny-fp8"), dtype=torch.float32)
    block = fp8.layers[1]
    assert block.quant_ffn == "both" and fp8.layers[0].quant_ffn is True
    assert block.ffn.experts.is_fp8 and block.ffn.shared_experts.w13.is_fp8
    torch.manual_seed(0)
    x = torch.randn(5, fp8.args.hidden_size)
    h, h_q = block.ffn_norm(x, quant="both")
    assert torch.equal(h, block.ffn_norm(x))
    assert torch.equal(block.ffn(h, h_q), block.ffn(h))
