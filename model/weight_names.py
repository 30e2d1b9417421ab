"""The one table from official checkpoint tensor names to pdserve parameters.

`checkpoint_weights(args, num_mtp)` lists, in the order the official shards store them, every weight tensor a
DeepSeek-V3 checkpoint holds: its name, shape, and where it lands in `Transformer` (routed experts land in a row
range of one expert of the stacked `w13` / `w2`). FP8 scales are not listed: every tensor marked `quantizable` may
come as float8_e4m3fn plus `<name>_scale_inv` (see `scale_spec`). The MTP module j is stored as layer
num_hidden_layers + j, holding its own embedding and head copies.

Given a `ParallelLayout`, the table says where one rank's share lands: a tensor split over tensor-parallel ranks
carries the slice this rank reads (`read`) and lands in the rank's smaller parameter; routed experts keep their
global id (`expert`), and the loader keeps only this rank's (`ParallelLayout.local_experts`).
"""

from __future__ import annotations

import dataclasses
import math

from .args import QUANT_BLOCK, ModelArgs, stacked_rows
from .parallel import SINGLE_RANK, ParallelLayout


@dataclasses.dataclass(frozen=True, slots=True)
class WeightSpec:
    name: str
    """Checkpoint tensor name."""
    param: str
    """Parameter path in `Transformer`."""
    shape: tuple[int, ...]
    quantizable: bool = False
    """The tensor may come as e4m3 with a 128x128 `weight_scale_inv` (a Linear weight)."""
    official_fp8: bool = True
    """When quantizable: the official FP8 checkpoints store it as fp8 (eh_proj is kept bf16)."""
    fp8_owner: str = ""
    """Module path whose fp8-ness this tensor decides (all tensors with one owner must agree)."""
    expert: int | None = None
    rows: tuple[int, int] | None = None
    """Row range inside the param (or param[expert]) when it stacks several projections (see `stacked`)."""
    read: tuple[int, int, int] | None = None
    """(dim, start, stop): the slice of the stored tensor this rank reads when tensor parallelism splits it
    (None: all of it). `shape` stays the stored tensor's."""
    is_scale: bool = False
    is_mtp: bool = False
    keep_fp32: bool = False
    """Loaded as fp32 whatever the model dtype (the router's correction bias)."""


def scale_spec(spec: WeightSpec) -> WeightSpec:
    """The `weight_scale_inv` companion of a quantizable weight."""
    assert spec.quantizable and spec.name.endswith(".weight")
    out_dim, in_dim = spec.shape
    rows = None
    if spec.rows is not None:
        rows = (spec.rows[0] // QUANT_BLOCK, math.ceil(spec.rows[1] / QUANT_BLOCK))
    read = None
    if spec.read is not None:
        dim, start, stop = spec.read
        read = (dim, start // QUANT_BLOCK, math.ceil(stop / QUANT_BLOCK))
    param = spec.param.removesuffix(".weight") + (
        "_scale_inv" if spec.expert is not None else ".weight_scale_inv"
    )
    return dataclasses.replace(
        spec,
        name=spec.name + "_scale_inv",
        param=param,
        shape=(math.ceil(out_dim / QUANT_BLOCK), math.ceil(in_dim / QUANT_BLOCK)),
        rows=rows,
        read=read,
        quantizable=False,
        is_scale=True,
    )


def stacked(w, param: str, in_dim: int, parts: list[tuple[str, int, int]]) -> list[WeightSpec]:
    """Checkpoint tensors `parts` (name, rows, tensor-parallel ranks splitting its rows) stacked into one
    Linear `param` at the `stacked_rows` offsets of this rank's shares."""
    offsets = stacked_rows(tuple(rows // tp for _, rows, tp in parts))
    return [
        w(name, param, (rows, in_dim), True, rows=(start, start + rows // tp), split=(0, tp))
        for (name, rows, tp), start in zip(parts, offsets, strict=True)
    ]


def _block(
    args: ModelArgs, layer: int, ckpt: str, param: str, is_mtp: bool, layout: ParallelLayout
) -> list[WeightSpec]:
    d, h = args.hidden_size, args.num_attention_heads
    attn_tp, dense_tp = layout.worker.attention_tp_size, layout.worker.dense_tp_size

    def w(name, p, shape, quantizable=False, owner="", split=(0, 1), **kw) -> WeightSpec:
        """split: (dim, ranks) that split the stored tensor along dim."""
        owner = owner or f"{param}.{p}".removesuffix(".weight")
        dim, ranks = split
        read = None if ranks == 1 else (dim, *layout.shard(shape[dim], ranks))
        return WeightSpec(
            f"{ckpt}.{name}", f"{param}.{p}", shape, quantizable, True, owner, is_mtp=is_mtp,
            read=read, **kw,
        )  # fmt: skip

    specs = [w("input_layernorm.weight", "attn_norm.weight", (d,))]
    a = "self_attn"
    # per-head tensors split by head over tensor-parallel attention ranks (a head's rows are contiguous)
    q_name, q_rows, q_tp = (
        ("q_proj", h * args.qk_head_dim, attn_tp) if args.q_lora_rank is None
        else ("q_a_proj", args.q_lora_rank, 1)
    )  # fmt: skip
    q_spec, kv_a_spec = stacked(
        w, "attn.wqkv_a.weight", d,
        [(f"{a}.{q_name}.weight", q_rows, q_tp),
         (f"{a}.kv_a_proj_with_mqa.weight", args.kv_cache_dim, 1)],
    )  # fmt: skip
    specs.append(q_spec)
    if args.q_lora_rank is not None:
        r = args.q_lora_rank
        specs += [
            w(f"{a}.q_a_layernorm.weight", "attn.q_norm.weight", (r,)),
            w(
                f"{a}.q_b_proj.weight",
                "attn.wq_b.weight",
                (h * args.qk_head_dim, r),
                True,
                split=(0, attn_tp),
            ),  # fmt: skip
        ]
    specs += [
        kv_a_spec,
        w(f"{a}.kv_a_layernorm.weight", "attn.kv_norm.weight", (args.kv_lora_rank,)),
        w(
            f"{a}.kv_b_proj.weight",
            "attn.wkv_b.weight",
            (h * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank),
            True,
            split=(0, attn_tp),
        ),  # fmt: skip
        w(
            f"{a}.o_proj.weight",
            "attn.wo.weight",
            (d, h * args.v_head_dim),
            True,
            split=(1, attn_tp),
        ),  # fmt: skip
        w("post_attention_layernorm.weight", "ffn_norm.weight", (d,)),
    ]
    if not args.is_moe_layer(layer):
        i = args.intermediate_size
        return specs + [
            *stacked(
                w,
                "ffn.w13.weight",
                d,
                [("mlp.gate_proj.weight", i, dense_tp), ("mlp.up_proj.weight", i, dense_tp)],
            ),  # fmt: skip
            w("mlp.down_proj.weight", "ffn.w2.weight", (d, i), True, split=(1, dense_tp)),
        ]
    e, i = args.n_routed_experts, args.moe_intermediate_size
    specs += [
        w("mlp.gate.weight", "ffn.gate.weight", (e, d)),
        w("mlp.gate.e_score_correction_bias", "ffn.gate.bias", (e,), keep_fp32=True),
    ]
    owner = f"{param}.ffn.experts"
    for x in range(e):
        p = f"mlp.experts.{x}"
        specs += [
            w(
                f"{p}.gate_proj.weight",
                "ffn.experts.w13",
                (i, d),
                True,
                owner,
                expert=x,
                rows=(0, i),
            ),
            w(
                f"{p}.up_proj.weight",
                "ffn.experts.w13",
                (i, d),
                True,
                owner,
                expert=x,
                rows=(i, 2 * i),
            ),
            w(f"{p}.down_proj.weight", "ffn.experts.w2", (d, i), True, owner, expert=x),
        ]
    if args.n_shared_experts:
        si = i * args.n_shared_experts
        p = "mlp.shared_experts"
        specs += [
            *stacked(
                w,
                "ffn.shared_experts.w13.weight",
                d,
                [(f"{p}.gate_proj.weight", si, dense_tp), (f"{p}.up_proj.weight", si, dense_tp)],
            ),  # fmt: skip
            w(
                f"{p}.down_proj.weight",
                "ffn.shared_experts.w2.weight",
                (d, si),
                True,
                split=(1, dense_tp),
            ),  # fmt: skip
        ]
    return specs


def _mtp(args: ModelArgs, depth: int, layout: ParallelLayout) -> list[WeightSpec]:
    """MTP module `depth`, stored as layer num_hidden_layers + depth with its own embedding and head copies."""
    d, v = args.hidden_size, args.vocab_size
    layer = args.num_hidden_layers + depth
    ckpt, param = f"model.layers.{layer}", f"mtp.{depth}"

    def m(name: str, p: str, shape: tuple[int, ...], quantizable: bool = False) -> WeightSpec:
        owner = f"{param}.{p}".removesuffix(".weight")
        return WeightSpec(
            f"{ckpt}.{name}", f"{param}.{p}", shape, quantizable, False, owner, is_mtp=True
        )

    return [
        m("embed_tokens.weight", "embed.weight", (v, d)),
        m("enorm.weight", "enorm.weight", (d,)),
        m("hnorm.weight", "hnorm.weight", (d,)),
        m("eh_proj.weight", "eh_proj.weight", (d, 2 * d), quantizable=True),
        *_block(args, layer, ckpt, f"{param}.block", True, layout),
        m("shared_head.norm.weight", "head_norm.weight", (d,)),
        m("shared_head.head.weight", "head.weight", (v, d)),
    ]


def checkpoint_weights(
    args: ModelArgs, num_mtp: int, layout: ParallelLayout = SINGLE_RANK
) -> list[WeightSpec]:
    """Every weight tensor (not scales) of a checkpoint with `num_mtp` MTP modules, in storage order, placed
    for one rank of `layout` (all experts listed, by global id)."""
    d, v = args.hidden_size, args.vocab_size
    specs = [WeightSpec("model.embed_tokens.weight", "embed.weight", (v, d))]
    for layer in range(args.num_hidden_layers):
        specs += _block(args, layer, f"model.layers.{layer}", f"layers.{layer}", False, layout)
    for depth in range(num_mtp):
        specs += _mtp(args, depth, layout)
    specs += [
        WeightSpec("model.norm.weight", "norm.weight", (d,)),
        WeightSpec("lm_head.weight", "head.weight", (v, d)),
    ]
    return specs
