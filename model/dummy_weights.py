"""`load_format="dummy"`: one rank's model filled with random weights of the checkpoint's shapes, made on the
target device from config.json alone (no tensor is read from disk), for running full-size shapes without the
weights. Tensors follow the same name table and the same per-name seeds as `make_checkpoint`, so a dummy model
equals the model loaded from `make_checkpoint(..., seed=seed)` of the same config; fp8 weights come quantized with
their block scales, so forward passes stay finite. Each tensor is made whole on the device and this rank's share
copied out of it, one tensor at a time: another rank's routed experts are never made.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .args import ModelArgs
from .deepseek import Transformer
from .loader import _check_fp8_split, _copy_into, default_dtype
from .parallel import ParallelLayout
from .random_checkpoint import is_fp8_weight, make_tensor
from .weight_names import WeightSpec, checkpoint_weights, scale_spec


def load_dummy(
    path: str | Path,
    device: torch.device | str,
    dtype: torch.dtype | None,
    use_mtp: bool,
    layout: ParallelLayout,
    seed: int,
) -> Transformer:
    """See `loader.load_model` (load_format="dummy"); `path` needs only config.json."""
    args = ModelArgs.from_json(Path(path))
    layout.worker.check_model(args)
    dtype = dtype or default_dtype(path)
    num_mtp = args.num_nextn_predict_layers if use_mtp else 0
    specs = checkpoint_weights(args, num_mtp, layout)
    fp8_owners = {s.fp8_owner for s in specs if is_fp8_weight(args, s)}
    with torch.device(device):
        model = Transformer(args, dtype, lambda p: p in fp8_owners, num_mtp, layout)
    params = dict(model.named_parameters())
    local_experts = layout.local_experts(args.n_routed_experts)
    for spec in specs:
        if spec.expert is not None:
            if spec.expert not in local_experts:
                continue
            spec = dataclasses.replace(spec, expert=spec.expert - local_experts.start)
        fp8 = is_fp8_weight(args, spec)
        if fp8:
            _check_fp8_split(spec, layout)
        tensors = make_tensor(spec, fp8, seed, dtype, device)
        _copy_into(params, spec, _share(tensors[spec.name], spec))
        if fp8:
            scale = scale_spec(spec)
            _copy_into(params, scale, _share(tensors[scale.name], scale))
    return model.eval()


def _share(tensor: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    if spec.read is None:
        return tensor
    dim, start, stop = spec.read
    return tensor.narrow(dim, start, stop - start)
