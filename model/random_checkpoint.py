"""Random-weight checkpoints in the official DeepSeek-V3 layout, for tests and benchmarks without real weights.

Writes config.json (spelled as the official repos spell it), generation_config.json, safetensors shards with
model.safetensors.index.json (per-expert tensor names, `weight_scale_inv` for fp8, the MTP layer stored as layer
num_hidden_layers), and a small locally trained tokenizer. Tensors are generated and written shard by shard, large
ones in row chunks, so peak memory stays near one shard. Each tensor's values depend only on the seed and its name.
Weights are scaled 1/sqrt(fan_in) and norms near 1, so activations stay O(1) through every layer.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .. import kernels
from .args import ModelArgs
from .errors import ConfigError
from .loader import INDEX_FILE
from .tokenizer import build_tokenizer
from .weight_names import WeightSpec, checkpoint_weights, scale_spec

DEFAULT_SHARD_BYTES = 2 << 30
_CHUNK_ELEMENTS = 1 << 24  # rows are generated in chunks of about this many values

_V3_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

PRESETS: dict[str, dict[str, Any]] = {
    # CI: seconds on a CPU; MTP, one dense layer, grouped routing, YaRN; fp8-compatible sizes.
    "tiny": {
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "q_lora_rank": 96,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "max_position_embeddings": 4096,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 4,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 1024,
            "type": "yarn",
        },
    },
    # DeepSeek-V2-Lite's dimensions with V3's routing and layout.
    "v2-lite-shape": {
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": None,
        "routed_scaling_factor": 1.0,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    },
    "v3-shape": {},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.bfloat16}


def preset_config(
    preset: str, layers: int | None = None, dtype: str = "bf16", overrides: dict | None = None
) -> dict[str, Any]:
    """The config.json a preset writes."""
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r}: expected one of {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    config = copy.deepcopy(_V3_CONFIG)
    config.update(copy.deepcopy(PRESETS[preset]))
    if layers is not None:
        if layers <= 0:
            raise ConfigError(f"--layers {layers}: must be positive")
        config["num_hidden_layers"] = layers
        config["first_k_dense_replace"] = min(config["first_k_dense_replace"], layers)
    if dtype != "fp8":
        del config["quantization_config"]
    config["torch_dtype"] = "float32" if dtype == "fp32" else "bfloat16"
    config.update(overrides or {})
    return config


@dataclasses.dataclass(frozen=True, slots=True)
class _Planned:
    spec: WeightSpec
    fp8: bool
    nbytes: int


def make_checkpoint(
    out: str | Path,
    preset: str = "tiny",
    layers: int | None = None,
    dtype: str = "bf16",
    seed: int = 0,
    overrides: dict | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    device: str = "cpu",
    progress: bool | None = None,
    weights: bool = True,
) -> Path:
    """Writes a random checkpoint to `out` (created; must be empty if it exists) and returns its path.
    weights=False: config.json, generation_config.json and the tokenizer only, for `load_format="dummy"`
    (whose weights for `seed` equal the ones written here)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out}: exists and is not empty")
    config = preset_config(preset, layers, dtype, overrides)
    args = ModelArgs.from_dict(config)
    out.mkdir(parents=True, exist_ok=True)
    if weights:
        _write_weights(out, args, dtype, seed, shard_bytes, device, progress)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "_from_model_config": True,
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "transformers_version": "4.46.3",
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    build_tokenizer(out, args.vocab_size, args.max_position_embeddings)
    return out


def _write_weights(
    out: Path, args: ModelArgs, dtype: str, seed: int, shard_bytes: int, device: str,
    progress: bool | None,
) -> None:  # fmt: skip
    """The safetensors shards and their index (see `make_checkpoint`)."""
    weight_dtype = DTYPES[dtype]
    planned: list[_Planned] = []
    for spec in checkpoint_weights(args, args.num_nextn_predict_layers):
        fp8 = is_fp8_weight(args, spec)
        dt = torch.float8_e4m3fn if fp8 else torch.float32 if spec.keep_fp32 else weight_dtype
        planned.append(_Planned(spec, fp8, _numel(spec.shape) * dt.itemsize))
        if fp8:
            scale = scale_spec(spec)
            planned.append(_Planned(scale, False, _numel(scale.shape) * 4))
    shards = _split_shards(planned, shard_bytes)
    weight_map: dict[str, str] = {}
    show = progress if progress is not None else os.isatty(2)
    total = sum(p.nbytes for p in planned)
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=not show) as bar:
        for k, shard in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors: dict[str, torch.Tensor] = {}
            for p in shard:
                if p.spec.is_scale:
                    continue  # produced with its weight
                for name, tensor in make_tensor(p.spec, p.fp8, seed, weight_dtype, device).items():
                    tensors[name] = tensor.cpu()
                    weight_map[name] = file
                    bar.update(tensor.numel() * tensor.element_size())
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _split_shards(planned: list[_Planned], shard_bytes: int) -> list[list[_Planned]]:
    """Groups tensors in order into shards of at most shard_bytes (a weight stays with its scale)."""
    shards: list[list[_Planned]] = [[]]
    size = 0
    for p in planned:
        if shards[-1] and size + p.nbytes > shard_bytes and not p.spec.is_scale:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _seed_name(spec: WeightSpec) -> str:
    """MTP modules hold copies of the shared embedding and head: give them the same values."""
    if spec.name.endswith(".embed_tokens.weight"):
        return "model.embed_tokens.weight"
    if spec.name.endswith(".shared_head.head.weight"):
        return "lm_head.weight"
    return spec.name


def is_fp8_weight(args: ModelArgs, spec: WeightSpec) -> bool:
    """Whether a checkpoint of `args` made here stores this tensor as fp8 (as the official FP8 ones do)."""
    return args.quantization is not None and spec.quantizable and spec.official_fp8


def make_tensor(
    spec: WeightSpec, fp8: bool, seed: int, dtype: torch.dtype, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The stored tensor `spec` names (and its scales when fp8), whole, on `device`; its values depend only on
    the seed and the name."""
    gen = torch.Generator(device=device).manual_seed(_tensor_seed(seed, _seed_name(spec)))
    name = spec.name
    if name.endswith("e_score_correction_bias"):
        return {name: 0.05 * torch.randn(spec.shape, generator=gen, device=device)}
    if len(spec.shape) == 1:  # norm weights
        w = 1.0 + 0.1 * torch.randn(spec.shape, generator=gen, device=device)
        return {name: w.to(dtype)}
    is_embedding = name.endswith("embed_tokens.weight")
    std = 1.0 if is_embedding else spec.shape[1] ** -0.5
    if not fp8:
        return {name: _randn_rows(spec.shape, std, dtype, gen, device)}
    w = _randn_rows(spec.shape, std, torch.float32, gen, device)  # the fp32 checkpoint's values
    w_fp8, scale_inv = kernels.quantize_weight(w)
    return {name: w_fp8, scale_spec(spec).name: scale_inv}


def _randn_rows(shape, std: float, dtype: torch.dtype, gen, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    rows = max(1, _CHUNK_ELEMENTS // shape[1])
    for start in range(0, shape[0], rows):
        n = min(rows, shape[0] - start)
        chunk = torch.randn((n, shape[1]), generator=gen, device=device)
        out[start : start + n] = (chunk * std).to(dtype)
    return out


def cache_dir() -> Path:
    """Where pdserve keeps checkpoints it makes itself ($XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pdserve"


CACHED_PRESET_VERSION = 4
"""Bump when a preset's weights or layout change, so stale cached copies are not reused."""


def cached_preset(preset: str = "tiny", dtype: str = "bf16") -> Path:
    """A random checkpoint of `preset` made once and reused from the cache dir (made atomically: concurrent
    callers never see a half-written directory)."""
    final = cache_dir() / "models" / f"{preset}-{dtype}-v{CACHED_PRESET_VERSION}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.{os.getpid()}.tmp"
    make_checkpoint(tmp, preset, dtype=dtype, progress=False)
    try:
        os.rename(tmp, final)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(model: str) -> Path:
    """`--model` accepts a checkpoint directory or `tiny` (the embedded default, made once and cached)."""
    if model == "tiny" and not Path(model).exists():
        return cached_preset("tiny")
    path = Path(model)
    if not path.is_dir():
        raise ConfigError(f"--model {model}: not a checkpoint directory (or 'tiny')")
    return path
