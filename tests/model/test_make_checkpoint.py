"""`pdserve make-checkpoint`: the official layout (index + shards, per-expert names, fp8 scales, MTP layer,
config spelling), deterministic values, and a local tokenizer that round-trips text."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from pdserve.cli.main import main as cli_main
from pdserve.model.errors import ConfigError
from pdserve.model.random_checkpoint import make_checkpoint
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer


def stored(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for name, file in index["weight_map"].items():
        with safe_open(path / file, framework="pt") as f:
            out[name] = f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())
    return index, out


def test_fp8_layout(checkpoint):
    path = checkpoint("tiny-fp8")
    index, tensors = stored(path)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }  # fmt: skip
    assert config["rope_scaling"]["type"] == "yarn" and config["architectures"] == [
        "DeepseekV3ForCausalLM"
    ]
    assert len(set(index["weight_map"].values())) > 1, "sharded"
    e = "model.layers.1.mlp.experts.15.down_proj"
    assert tensors[f"{e}.weight"] == ("F8_E4M3", (256, 128))
    assert tensors[f"{e}.weight_scale_inv"] == ("F32", (2, 1))
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"][1] == (1, 2)
    assert tensors["model.layers.1.mlp.gate.weight"][0] == "BF16"
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"][0] == "F32"
    for name in (
        "embed_tokens",
        "enorm",
        "hnorm",
        "eh_proj",
        "shared_head.norm",
        "shared_head.head",
    ):
        assert f"model.layers.2.{name}.weight" in tensors  # the MTP layer, at num_hidden_layers
    assert tensors["model.layers.2.eh_proj.weight"][0] == "BF16"
    assert (path / "generation_config.json").is_file()


def test_values_depend_only_on_seed(tmp_path):
    a = make_checkpoint(
        tmp_path / "a", "tiny", layers=1, seed=3, shard_bytes=1 << 20, progress=False
    )
    b = make_checkpoint(
        tmp_path / "b", "tiny", layers=1, seed=3, shard_bytes=8 << 20, progress=False
    )
    name = "model.layers.0.self_attn.q_b_proj.weight"
    ia = json.loads((a / "model.safetensors.index.json").read_text())["weight_map"]
    ib = json.loads((b / "model.safetensors.index.json").read_text())["weight_map"]
    with (
        safe_open(a / ia[name], framework="pt") as fa,
        safe_open(b / ib[name], framework="pt") as fb,
    ):
        assert torch.equal(fa.get_tensor(name), fb.get_tensor(name))


def test_cli_layers_and_override(tmp_path, capsys):
    out = tmp_path / "ck"
    code = cli_main(["make-checkpoint", str(out), "--preset", "tiny", "--layers", "1",
                     "--override", "q_lora_rank=null", "--seed", "1"])  # fmt: skip
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["q_lora_rank"] is None
    assert config["first_k_dense_replace"] == 1
    _, tensors = stored(out)
    assert "model.layers.0.self_attn.q_proj.weight" in tensors
    assert cli_main(["make-checkpoint", str(out)]) == 2  # not empty
    assert "not empty" in capsys.readouterr().err


def test_bad_preset_and_dtype(tmp_path):
    with pytest.raises(ConfigError, match="--preset"):
        make_checkpoint(tmp_path / "x", "v9")
    with pytest.raises(ConfigError, match="--dtype"):
        make_checkpoint(tmp_path / "y", "tiny", dtype="int4")


def test_tokenizer_round_trip(checkpoint):
    tok = Tokenizer(checkpoint("tiny-bf16"))
    text = "Hello, world! The quick brown fox: 1024 tokens, émigré naïve — 東京."
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 0 and tok.eos_id == 1
    assert len(ids) < len(text.encode()), "BPE merges common words"
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok, ids[:1])
    pieces = [detok.push([i]) for i in ids[1:]]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
