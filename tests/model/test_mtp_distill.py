"""MTP distillation (`model/mtp_distill.py`, `model/mtp_train.py`): the differentiable MTP forward equals
`Transformer.mtp_logits`; distilling the tiny preset raises the held-out agreement of the MTP module's argmax with
the main model's greedy token well above the untrained module's; the written checkpoint loads, its non-MTP
tensors keep their bytes, and fp8 MTP weights come back re-quantized with their block scales."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from pdserve.kernels.fp8_quant import dequantize_weight
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.errors import ConfigError
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model
from pdserve.model.mtp_distill import DistillConfig, distill_mtp
from pdserve.model.mtp_train import TrainableMTP


def all_tensors(path):
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, file in weight_map.items():
        with safe_open(path / file, framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def mtp_logits_both_ways(model, seqs):
    """(Transformer.mtp_logits over a paged prefill, TrainableMTP's forward), each [B * (S-1), V]."""
    bsz, seq = len(seqs), len(seqs[0])
    page_size, pages = 16, -(-seq // 16)
    layout = KVCacheLayout.for_model(model.args, page_size, torch.float32, model.num_mtp)
    cache = PagedKVCache(layout, bsz * pages, "cpu")
    page_ids = [range(b * pages, (b + 1) * pages) for b in range(bsz)]
    main = build_forward_batch(
        [SeqChunk(s, 0, page_ids[b]) for b, s in enumerate(seqs)], page_size, "cpu", decode=False
    )
    hidden = model(main, cache)  # [B * S, D]
    mtp = build_forward_batch(
        [SeqChunk(s[1:], 0, page_ids[b]) for b, s in enumerate(seqs)], page_size, "cpu", False
    )
    keep = torch.tensor([i for i in range(bsz * seq) if i % seq != seq - 1])  # h_t for t < S-1
    _, expected = model.mtp_logits(0, hidden[keep], mtp.input_ids, mtp, cache)
    with torch.no_grad():
        got = TrainableMTP(model)(
            hidden.clone().view(bsz, seq, -1)[:, :-1], torch.tensor(seqs)[:, 1:]
        )
    return expected, got.reshape(expected.shape)


def test_training_forward_matches_mtp_logits(checkpoint):
    model = load_model(checkpoint("tiny-fp32"))
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, model.args.vocab_size, (3, 21), generator=g).tolist()
    expected, got = mtp_logits_both_ways(model, seqs)
    err = (got - expected).abs().max().item()
    assert err <= 1e-4 * expected.abs().max().item(), f"max|dlogit|={err}"


def test_distillation_raises_agreement_and_keeps_the_rest(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("tiny-fp32"), tmp_path / "ck")
    before = all_tensors(path)
    lines = []
    config = DistillConfig(
        steps=60, lr=3e-3, seq_len=32, batch_size=16, train_sequences=128, eval_sequences=16,
        log_every=20,
    )  # fmt: skip
    result = distill_mtp(path, config, log=lines.append)
    # untrained: about 1/vocab; distilled: tens of times that on the held-out rows
    assert result.final_agreement >= result.initial_agreement + 0.04, result
    assert sum(line.startswith("step ") for line in lines) == 3
    after = all_tensors(path)
    assert after.keys() == before.keys()
    mtp_prefix = (
        f"model.layers.{json.loads((path / 'config.json').read_text())['num_hidden_layers']}."
    )
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(n.startswith(mtp_prefix) for n in changed)
    assert not any(".mlp.experts." in n or "embed_tokens" in n or "shared_head.head" in n
                   for n in changed)  # fmt: skip
    assert result.tensors_written >= len(changed)
    model = load_model(path)  # the loader's checks pass
    g = torch.Generator().manual_seed(2)
    seqs = torch.randint(0, model.args.vocab_size, (2, 17), generator=g).tolist()
    expected, got = mtp_logits_both_ways(model, seqs)
    assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()


def test_fp8_weights_are_requantized(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("tiny-fp8"), tmp_path / "ck")
    before = all_tensors(path)
    config = DistillConfig(
        steps=3, lr=1e-2, seq_len=12, batch_size=4, train_sequences=4, eval_sequences=2
    )
    distill_mtp(path, config, log=lambda _: None)
    after = all_tensors(path)
    layer = "model.layers.2.self_attn.q_b_proj"
    w, s = after[f"{layer}.weight"], after[f"{layer}.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and s.shape == before[f"{layer}.weight_scale_inv"].shape
    assert not torch.equal(dequantize_weight(w, s), dequantize_weight(before[f"{layer}.weight"],
                                                                      before[f"{layer}.weight_scale_inv"]))  # fmt: skip
    eh = "model.layers.2.eh_proj.weight"  # stored bf16 in the official fp8 layout, and so it stays
    assert after[eh].dtype == torch.bfloat16 and not torch.equal(after[eh], before[eh])
    for name, tensor in before.items():
        if not name.startswith("model.layers.2."):
            assert torch.equal(after[name], tensor), name
    model = load_model(path)
    assert model.mtp[0].block.attn.wq_b.is_fp8


@pytest.mark.parametrize(
    "field, value",
    [("steps", 0), ("lr", 0.0), ("lr", float("nan")), ("seq_len", 9), ("device", "tpu:0"),
     ("batch_size", -1)],
)  # fmt: skip
def test_bad_config_values_are_named(field, value):
    with pytest.raises(ConfigError, match=field):
        DistillConfig(**{"steps": 1, field: value})


def test_checkpoint_without_mtp_is_refused(checkpoint):
    with pytest.raises(ConfigError, match="no MTP module"):
        distill_mtp(checkpoint("plain-fp32"), DistillConfig(steps=1), log=lambda _: None)
