"""`ModelArgs`: the model's shape and numerics, read from a checkpoint's `config.json`.

Every field the DeepSeek-V3/R1 configs use is read; anything pdserve cannot run raises `ConfigError` naming the field
and its value. Fields the configs carry that change nothing here (architectures, initializer_range, ...) are ignored.
Both spellings of the RoPE settings are accepted: `rope_theta` + `rope_scaling` (the official repos) and
`rope_parameters` (newer transformers).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from .errors import ConfigError

QUANT_BLOCK = 128


def stacked_rows(parts: tuple[int, ...]) -> tuple[int, ...]:
    """Row offsets of projections of one input stacked into one weight (so one GEMM computes them all): each part
    starts on a QUANT_BLOCK boundary, so no fp8 scale block spans two parts. Rows between parts stay zero."""
    offsets, end = [], 0
    for rows in parts:
        offsets.append(end)
        end += -(-rows // QUANT_BLOCK) * QUANT_BLOCK
    return tuple(offsets)


@dataclasses.dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN long-context RoPE scaling."""

    factor: float
    """Context extension factor."""
    original_max_position_embeddings: int
    """Context length the model was pre-trained at."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    """0 when absent; with mscale_all_dim it sets the cos/sin scale."""
    mscale_all_dim: float = 0.0
    """0 when absent; otherwise the softmax scale is multiplied by yarn_mscale(factor, mscale_all_dim)^2."""
    attention_factor: float | None = None
    """Scale of cos/sin; derived from mscale / mscale_all_dim when absent (as transformers does)."""

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ConfigError(f"rope_scaling.factor={self.factor}: must be > 0")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError(
                "rope_scaling.original_max_position_embeddings="
                f"{self.original_max_position_embeddings}: must be > 0"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8Quantization:
    """DeepSeek FP8: e4m3 weights with one fp32 `weight_scale_inv` per 128x128 quant block, dynamic activations."""

    weight_block_size: tuple[int, int] = (QUANT_BLOCK, QUANT_BLOCK)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelArgs:
    """DeepSeek-V3 architecture hyper-parameters, named as in config.json."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    """Dense MLP width (the first `first_k_dense_replace` layers)."""
    moe_intermediate_size: int = 2048
    """Width of each routed and shared expert."""
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    q_lora_rank: int | None = 1536
    """None: queries come from one projection (`q_proj`), as in DeepSeek-V2-Lite."""
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    num_nextn_predict_layers: int = 0
    """Multi-token-prediction modules stored after the main layers (at layer index num_hidden_layers + j)."""
    quantization: Fp8Quantization | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "n_routed_experts", "num_experts_per_tok",
            "n_group", "topk_group", "moe_layer_freq", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
        )  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"q_lora_rank={self.q_lora_rank}: must be a positive integer or null")
        if self.n_shared_experts < 0 or self.num_nextn_predict_layers < 0:
            raise ConfigError("n_shared_experts and num_nextn_predict_layers must be >= 0")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace={self.first_k_dense_replace}: must be in "
                f"[0, num_hidden_layers={self.num_hidden_layers}]"
            )
        if self.scoring_func != "sigmoid":
            raise ConfigError(f"scoring_func={self.scoring_func!r}: only 'sigmoid' is supported")
        if self.topk_method != "noaux_tc":
            raise ConfigError(f"topk_method={self.topk_method!r}: only 'noaux_tc' is supported")
        if self.moe_layer_freq != 1:
            raise ConfigError(f"moe_layer_freq={self.moe_layer_freq}: only 1 is supported")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"n_group={self.n_group}: must divide n_routed_experts={self.n_routed_experts}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(
                f"topk_group={self.topk_group}: must be in [1, n_group={self.n_group}]"
            )
        experts_in_groups = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > experts_in_groups:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok}: exceeds the {experts_in_groups} "
                "experts in the kept groups"
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim}: must be even")
        if self.quantization is not None:
            for name in ("hidden_size", "moe_intermediate_size"):
                if getattr(self, name) % QUANT_BLOCK:
                    raise ConfigError(
                        f"{name}={getattr(self, name)}: fp8 checkpoints need a multiple of "
                        f"{QUANT_BLOCK} (the quant block)"
                    )

    # Derived sizes, named as in the DeepSeek reference.
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def rope_attention_factor(self) -> float:
        """The scale YaRN folds into cos/sin (1 without scaling), as transformers computes it."""
        s = self.rope_scaling
        if s is None:
            return 1.0
        if s.attention_factor is not None:
            return float(s.attention_factor)
        if s.mscale and s.mscale_all_dim:
            return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
        return yarn_mscale(s.factor)

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale(mscale_all_dim)^2 when scaling is on."""
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """Builds args from a parsed config.json; raises ConfigError naming any bad field."""
        model_type = config.get("model_type", "deepseek_v3")
        if model_type != "deepseek_v3":
            raise ConfigError(f"model_type={model_type!r}: only 'deepseek_v3' is supported")
        _require_value(config, "hidden_act", "silu")
        _require_value(config, "attention_bias", False)
        _require_value(config, "rope_interleave", True)
        heads = config.get("num_attention_heads")
        if config.get("num_key_value_heads", heads) != heads:
            raise ConfigError(
                f"num_key_value_heads={config['num_key_value_heads']}: MLA needs it equal to "
                f"num_attention_heads={heads}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        nullable = {"q_lora_rank", "bos_token_id"}
        kwargs = {
            k: v for k, v in config.items() if k in fields and (v is not None or k in nullable)
        }
        kwargs.pop("rope_scaling", None)
        kwargs.pop("quantization", None)
        kwargs.pop("eos_token_ids", None)
        for name, value in list(kwargs.items()):
            default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
            if (
                isinstance(default, float)
                and isinstance(value, int)
                and not isinstance(value, bool)
            ):
                kwargs[name] = float(value)
        rope_theta, rope_scaling = _parse_rope(config)
        kwargs["rope_theta"] = rope_theta
        kwargs["rope_scaling"] = rope_scaling
        kwargs["quantization"] = _parse_quantization(config.get("quantization_config"))
        eos = config.get("eos_token_id", 1)
        kwargs["eos_token_ids"] = (
            tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
        )
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"config.json: {e}") from e

    @classmethod
    def from_json(cls, path: str | Path) -> ModelArgs:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json (is this a checkpoint directory?)")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(config)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _require_value(config: dict[str, Any], name: str, supported: Any) -> None:
    if name in config and config[name] != supported:
        raise ConfigError(f"{name}={config[name]!r}: only {supported!r} is supported")


def _parse_rope(config: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    params = config.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = config.get("rope_scaling"), "rope_scaling"
    theta = config.get("rope_theta")
    if theta is None and params:
        theta = params.get("rope_theta")
    theta = float(theta if theta is not None else 10000.0)
    if not params:
        return theta, None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ConfigError(f"{field}.type={rope_type!r}: only 'yarn' (or none) is supported")
    original = params.get("original_max_position_embeddings")
    if original is None:
        original = config.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = config["max_position_embeddings"] / original
    try:
        scaling = YarnScaling(
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            attention_factor=params.get("attention_factor"),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{field}: {e}") from e
    return theta, scaling


def _parse_quantization(qc: dict[str, Any] | None) -> Fp8Quantization | None:
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method={method!r}: only 'fp8' is supported")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt={fmt!r}: only 'e4m3' is supported")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(
            f"quantization_config.activation_scheme={scheme!r}: only 'dynamic' is supported"
        )
    block = tuple(qc.get("weight_block_size", (QUANT_BLOCK, QUANT_BLOCK)))
    if block != (QUANT_BLOCK, QUANT_BLOCK):
        raise ConfigError(
            f"quantization_config.weight_block_size={list(block)}: only [128, 128] is supported"
        )
    return Fp8Quantization(weight_block_size=block)
