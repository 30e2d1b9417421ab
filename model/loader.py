"""Loads a checkpoint directory in the official DeepSeek-V3 layout into a `Transformer`.

The directory holds config.json and either model.safetensors.index.json with its shards or one model.safetensors.
Shards are opened memory-mapped one at a time and each tensor is copied straight into its (pre-allocated) parameter
on the target device, so at most one tensor is in host memory beyond the model itself. FP8 tensors stay FP8 with
their scales. Every inconsistency raises a one-line `CheckpointError` naming the tensor, field or file; MTP tensors
that are absent while config.json asks for MTP only disable MTP, with a warning.

One rank of a `ParallelLayout` reads only its share: its routed experts, and of each tensor-parallel tensor the
slice it holds (`safe_open(...).get_slice`), never the other ranks' bytes. `load_format="dummy"` reads no tensor
at all: each parameter is filled with random values of the checkpoint's shapes on the target device (fp8 with
valid scales), from config.json alone, for running full-size shapes without the weights on disk.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from tqdm import tqdm

from .args import QUANT_BLOCK, ModelArgs
from .deepseek import Transformer
from .errors import CheckpointError, ConfigError
from .parallel import SINGLE_RANK, ParallelLayout
from .weight_names import WeightSpec, checkpoint_weights, scale_spec

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F64": torch.float64, "I64": torch.int64,
    "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CONFIG_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LoadFormat = Literal["safetensors", "dummy"]
LOAD_FORMATS = ("safetensors", "dummy")


@dataclasses.dataclass(frozen=True, slots=True)
class StoredTensor:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class LoadPlan:
    args: ModelArgs
    num_mtp: int
    fp8_owners: frozenset[str]
    specs: dict[str, WeightSpec]
    """Checkpoint name -> where it goes, for every tensor this rank will read (experts by local id)."""
    stored: dict[str, StoredTensor]
    layout: ParallelLayout = SINGLE_RANK


def read_checkpoint_tensors(path: Path) -> dict[str, StoredTensor]:
    """Reads every shard's header (not its data): tensor name -> file, dtype, shape."""
    index_path = path / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE_FILE).is_file():
        weight_map, files = {}, [SINGLE_FILE]
    else:
        raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
    stored: dict[str, StoredTensor] = {}
    for file in files:
        for name, tensor in _read_header(path, file).items():
            if name in stored:
                raise CheckpointError(f"{name}: stored twice, in {stored[name].file} and {file}")
            stored[name] = tensor
    for name, file in weight_map.items():
        if name not in stored or stored[name].file != file:
            raise CheckpointError(
                f"{name}: {INDEX_FILE} places it in {file}, which does not hold it"
            )
    return stored


def _read_header(path: Path, file: str) -> dict[str, StoredTensor]:
    full = path / file
    if not full.is_file():
        raise CheckpointError(f"{full}: shard listed in {INDEX_FILE} is missing")
    try:
        with safe_open(full, framework="pt") as f:
            out = {}
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                sl = f.get_slice(name)
                dtype_name = sl.get_dtype()
                if dtype_name not in _DTYPES:
                    raise CheckpointError(f"{name} in {file}: unsupported dtype {dtype_name}")
                dtype, shape = _DTYPES[dtype_name], tuple(sl.get_shape())
                numel = 1
                for s in shape:
                    numel *= s
                out[name] = StoredTensor(file, dtype, shape, numel * dtype.itemsize)
            return out
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise CheckpointError(
            f"{full}: unreadable safetensors file, truncated or corrupt? ({e})"
        ) from e


def plan_load(
    path: str | Path, use_mtp: bool = True, layout: ParallelLayout = SINGLE_RANK
) -> LoadPlan:
    """Checks a checkpoint directory against config.json without reading tensor data, and lists the tensors
    (and slices) that one rank of `layout` reads."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    args = ModelArgs.from_json(path)
    layout.worker.check_model(args)
    local_experts = layout.local_experts(args.n_routed_experts)
    stored = read_checkpoint_tensors(path)
    num_mtp = args.num_nextn_predict_layers if use_mtp else 0
    mtp_specs = [s for s in checkpoint_weights(args, args.num_nextn_predict_layers) if s.is_mtp]
    mtp_present = [s.name for s in mtp_specs if s.name in stored]
    if num_mtp and not mtp_present:
        logger.warning(
            "config.json has num_nextn_predict_layers=%d but the checkpoint holds no MTP tensors "
            "(e.g. %s): MTP disabled", args.num_nextn_predict_layers, mtp_specs[0].name,
        )  # fmt: skip
        num_mtp = 0
    specs: dict[str, WeightSpec] = {}
    known: set[str] = set()
    fp8_owners: set[str] = set()
    float_owners: set[str] = set()
    for spec in checkpoint_weights(args, num_mtp, layout):
        entry = stored.get(spec.name)
        if entry is None:
            if spec.name == "lm_head.weight" and args.tie_word_embeddings:
                continue
            raise CheckpointError(f"missing tensor {spec.name} (shape {list(spec.shape)})")
        _check_shape(spec, entry)
        if entry.dtype == torch.float8_e4m3fn:
            if not spec.quantizable:
                raise CheckpointError(
                    f"{spec.name} in {entry.file}: float8_e4m3fn, but this tensor is never quantized"
                )
            scale = scale_spec(spec)
            scale_entry = stored.get(scale.name)
            if scale_entry is None:
                raise CheckpointError(
                    f"missing tensor {scale.name} (the scales of fp8 {spec.name})"
                )
            _check_shape(scale, scale_entry)
            _check_fp8_split(spec, layout)
            known.add(scale.name)
            fp8_owners.add(spec.fp8_owner)
        elif entry.dtype in _FLOAT_DTYPES:
            float_owners.add(spec.fp8_owner)
        else:
            raise CheckpointError(f"{spec.name} in {entry.file}: unsupported dtype {entry.dtype}")
        known.add(spec.name)
        if spec.expert is not None and spec.expert not in local_experts:
            continue  # another rank's expert
        if spec.expert is not None:
            spec = dataclasses.replace(spec, expert=spec.expert - local_experts.start)
        specs[spec.name] = spec
        if entry.dtype == torch.float8_e4m3fn:
            specs[scale.name] = scale_spec(spec)
    mixed = fp8_owners & float_owners
    if mixed:
        raise CheckpointError(f"{sorted(mixed)[0]}: some of its tensors are fp8 and some are not")
    ignored = {s.name for s in mtp_specs} if num_mtp == 0 else set()
    ignored |= {scale_spec(s).name for s in mtp_specs if s.quantizable} if num_mtp == 0 else set()
    for name, entry in stored.items():
        if name not in known and name not in ignored:
            raise CheckpointError(f"unexpected tensor {name} in {entry.file}")
    return LoadPlan(args, num_mtp, frozenset(fp8_owners), specs, stored, layout)


def _check_fp8_split(spec: WeightSpec, layout: ParallelLayout) -> None:
    """An fp8 tensor can only be split on 128x128 quant block boundaries (each rank its own scales)."""
    if spec.read is None:
        return
    dim, start, stop = spec.read
    if start % QUANT_BLOCK or (stop % QUANT_BLOCK and stop != spec.shape[dim]):
        raise CheckpointError(
            f"{spec.name}: fp8 with {QUANT_BLOCK}x{QUANT_BLOCK} scale blocks; rank {layout.rank} of "
            f"{layout.worker.ranks} would read [{start}, {stop}) of dim {dim}, not whole blocks"
        )


def _check_shape(spec: WeightSpec, entry: StoredTensor) -> None:
    if entry.shape != spec.shape:
        raise CheckpointError(
            f"{spec.name} in {entry.file}: shape {list(entry.shape)}, expected {list(spec.shape)}"
        )


def default_dtype(path: str | Path) -> torch.dtype:
    """The activation dtype the checkpoint asks for (config.json's torch_dtype/dtype), bf16 by default."""
    config = json.loads((Path(path) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return _CONFIG_DTYPES.get(name, torch.bfloat16)


def load_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    use_mtp: bool = True,
    progress: bool | None = None,
    layout: ParallelLayout = SINGLE_RANK,
    load_format: LoadFormat = "safetensors",
    seed: int = 0,
) -> Transformer:
    """Builds one rank's model (`layout`; one rank by default) on `device` in `dtype` (config.json's by
    default) and fills it: from the checkpoint's tensors (`load_format="safetensors"`, only this rank's share
    is read), or with random weights made on `device` from config.json alone (`"dummy"`; `seed` picks them,
    and they equal the weights `make_checkpoint(..., seed=seed)` writes for the same config)."""
    path = Path(path)
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format={load_format!r}: expected one of {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        from .dummy_weights import load_dummy

        model = load_dummy(path, device, dtype, use_mtp, layout, seed)
        model.checkpoint_dir = str(path)
        return model
    plan = plan_load(path, use_mtp, layout)
    dtype = dtype or default_dtype(path)
    with torch.device(device):
        model = Transformer(plan.args, dtype, lambda p: p in plan.fp8_owners, plan.num_mtp, layout)
    params = dict(model.named_parameters())
    by_file: dict[str, list[str]] = {}
    for name in plan.specs:
        by_file.setdefault(plan.stored[name].file, []).append(name)
    total = sum(plan.stored[n].nbytes for n in plan.specs)  # whole tensors, split ones included
    show = progress if progress is not None else os.isatty(2)
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=not show) as bar:
        for file, names in sorted(by_file.items()):
            try:
                with safe_open(path / file, framework="pt") as f:
                    for name in names:
                        spec = plan.specs[name]
                        _copy_into(params, spec, _read(f, spec))
                        bar.update(plan.stored[name].nbytes)
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{path / file}: failed while reading tensors ({e})") from e
    if "lm_head.weight" not in plan.specs:
        model.head.weight.copy_(model.embed.weight)
    model.checkpoint_dir = str(path)
    return model.eval()


def _read(f, spec: WeightSpec) -> torch.Tensor:
    """The stored tensor, or for a split one only this rank's slice of the memory map."""
    if spec.read is None:
        return f.get_tensor(spec.name)
    dim, start, stop = spec.read
    index = (slice(None),) * dim + (slice(start, stop),)
    return f.get_slice(spec.name)[index]


def _copy_into(
    params: dict[str, torch.nn.Parameter], spec: WeightSpec, tensor: torch.Tensor
) -> None:
    dst = params[spec.param].data
    if spec.expert is not None:
        dst = dst[spec.expert]
    if spec.rows is not None:
        dst = dst[spec.rows[0] : spec.rows[1]]
    dst.copy_(tensor)
