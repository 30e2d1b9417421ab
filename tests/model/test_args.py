"""ModelArgs from config.json: both RoPE spellings, and a one-line ConfigError naming any unsupported value."""

from __future__ import annotations

import json

import pytest

from pdserve.model.args import ModelArgs
from pdserve.model.errors import ConfigError
from pdserve.model.random_checkpoint import preset_config


def test_official_v3_config():
    args = ModelArgs.from_dict(preset_config("v3-shape", dtype="fp8"))
    assert args.hidden_size == 7168 and args.n_routed_experts == 256 and args.q_lora_rank == 1536
    assert args.quantization is not None and args.quantization.weight_block_size == (128, 128)
    assert args.rope_scaling.factor == 40 and args.num_nextn_predict_layers == 1
    # YaRN mscale 0.1*ln(40)+1 squared on 1/sqrt(192).
    assert args.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 3.6888794541 + 1) ** 2)
    assert args.eos_token_ids == (1,)


def test_rope_parameters_spelling_equals_rope_scaling():
    old = preset_config("tiny")
    new = dict(old)
    scaling = dict(new.pop("rope_scaling"))
    scaling["rope_type"] = scaling.pop("type")
    scaling["rope_theta"] = new.pop("rope_theta")
    new["rope_parameters"] = scaling
    assert ModelArgs.from_dict(old) == ModelArgs.from_dict(new)


def test_null_q_lora_rank_and_eos_list():
    config = preset_config("v2-lite-shape") | {"eos_token_id": [1, 2]}
    args = ModelArgs.from_dict(config)
    assert args.q_lora_rank is None and args.eos_token_ids == (1, 2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("scoring_func", "softmax"),
        ("topk_method", "greedy"),
        ("hidden_act", "gelu"),
        ("num_key_value_heads", 1),
        ("moe_layer_freq", 2),
        ("n_group", 3),
        ("model_type", "llama"),
        ("hidden_size", -4),
    ],
)
def test_unsupported_values_name_the_field(field, value):
    config = preset_config("tiny") | {field: value}
    with pytest.raises(ConfigError, match=field):
        ModelArgs.from_dict(config)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
        (
            {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}},
            "quantization_config.fmt",
        ),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
            "quantization_config.weight_block_size",
        ),
    ],
)
def test_unsupported_nested_values_name_the_field(patch, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelArgs.from_dict(preset_config("tiny") | patch)


def test_missing_and_malformed_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelArgs.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelArgs.from_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny")))
    assert ModelArgs.from_json(tmp_path).vocab_size == 1024
