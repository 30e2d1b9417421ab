"""The MTP module's logits for position t+2 against a direct torch computation from the checkpoint tensors.

transformers has no DeepSeek MTP we can load from this layout, so the reference is built here by hand:
h_t = transformers' final-norm hidden state of the main model at position t; for each t the module sees
x_t = eh_proj([RMSNorm_e(embed(tok_{t+1})); RMSNorm_h(h_t)]), then one decoder layer — a transformers
`DeepseekV3DecoderLayer` whose weights are read from the checkpoint's layer `num_hidden_layers` tensors (experts
packed the way transformers stores them), causal over t = 0..T-2 at positions t — then shared_head.norm and
shared_head.head. pdserve must give the same logits (fp32, 1e-4 of the max).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402


def read_tensors(path, prefix):
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, file in weight_map.items():
        if name.startswith(prefix):
            with safe_open(path / file, framework="pt") as f:
                out[name[len(prefix) :]] = f.get_tensor(name).float()
    return out


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_mtp_logits_match_direct_computation(checkpoint):
    path = checkpoint("tiny-fp32")
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = hf.config
    n_layers, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    t = read_tensors(path, f"model.layers.{n_layers}.")
    layer = hf_ds.DeepseekV3DecoderLayer(cfg, layer_idx=n_layers).eval()
    state = {k: v for k, v in t.items() if k.split(".")[0] in ("self_attn", "input_layernorm",
                                                                 "post_attention_layernorm")}  # fmt: skip
    state["mlp.gate.weight"] = t["mlp.gate.weight"]
    state["mlp.gate.e_score_correction_bias"] = t["mlp.gate.e_score_correction_bias"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        state[f"mlp.shared_experts.{name}.weight"] = t[f"mlp.shared_experts.{name}.weight"]
    num_experts = cfg.n_routed_experts
    state["mlp.experts.gate_up_proj"] = torch.stack([
        torch.cat([t[f"mlp.experts.{e}.gate_proj.weight"], t[f"mlp.experts.{e}.up_proj.weight"]])
        for e in range(num_experts)
    ])  # fmt: skip
    state["mlp.experts.down_proj"] = torch.stack(
        [t[f"mlp.experts.{e}.down_proj.weight"] for e in range(num_experts)]
    )
    layer.load_state_dict(state, strict=True)

    g = torch.Generator().manual_seed(5)
    ids = [0, *torch.randint(3, cfg.vocab_size, (40,), generator=g).tolist()]
    T = len(ids)
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state  # [1, T, D], after the final norm
        e = rms(
            F.embedding(torch.tensor([ids[1:]]), t["embed_tokens.weight"]), t["enorm.weight"], eps
        )
        x = torch.cat([e, rms(h[:, :-1], t["hnorm.weight"], eps)], -1) @ t["eh_proj.weight"].T
        positions = torch.arange(T - 1)[None]
        mask = torch.full((T - 1, T - 1), float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=mask, position_ids=positions,
                  position_embeddings=hf.model.rotary_emb(x, positions))  # fmt: skip
        x = x[0] if isinstance(x, tuple) else x
        expected = rms(x, t["shared_head.norm.weight"], eps) @ t["shared_head.head.weight"].T
    expected = expected[0]  # [T-1, V]: logits for positions 2..T

    ours = load_model(path, dtype=torch.float32)
    assert ours.num_mtp == 1
    page_size, num_pages = 16, -(-T // 16)
    layout = KVCacheLayout.for_model(ours.args, page_size, torch.float32, ours.num_mtp)
    cache = PagedKVCache(layout, num_pages, "cpu")
    pages = list(range(num_pages))
    main = build_forward_batch([SeqChunk(ids, 0, pages)], page_size, "cpu", decode=False)
    hidden = ours(main, cache)  # [T, D]
    mtp = build_forward_batch([SeqChunk(ids[1:], 0, pages)], page_size, "cpu", decode=False)
    _, got = ours.mtp_logits(0, hidden[:-1], mtp.input_ids, mtp, cache)
    err = (got - expected).abs().max().item()
    assert err <= 1e-4 * expected.abs().max().item(), f"max|dlogit|={err}"
