"""What one rank of a worker holds besides its KV cache: its weights, by group, and its activation and workspace
reserve, for a model (`ModelArgs` and the weights' dtype) and a `WorkerLayout`. Arithmetic over shapes only: no
GPU, no weights read.

Weights are counted tensor by tensor from `checkpoint_weights`, as the loader stores them: fp8 checkpoints hold
every quantizable tensor the official ones quantize as e4m3 plus fp32 `weight_scale_inv` per 128x128 quant block;
the router's bias in fp32; the rest in the model dtype. Per rank: routed experts n_routed_experts / EP of them;
attention heads split under attention TP (q_b/q, kv_b by rows, o by columns); the dense layers' MLP and the shared
experts split by their intermediate dim under dense TP; everything else (embedding, lm_head, norms, the router,
the MLP projections of MTP) whole on every rank. MTP modules count with their own embedding and head copies, as
the model allocates them. Three groups are not checkpoint tensors but memory the model allocates from them: the
activation-dtype copy of an fp8 `wkv_b` that absorbed decode attention reads, the zero rows between stacked
projections (`stacked_rows`), and the spare expert slots of expert balancing (`WorkerLayout.redundant_experts`:
one routed expert's tensors per spare slot per main MoE layer).
"""

from __future__ import annotations

import functools
import math

import torch

from pdserve.engine.step import MAX_GRAPH_ROWS
from pdserve.model.args import QUANT_BLOCK, ModelArgs
from pdserve.model.batch import PREFIX_BLOCK_TOKENS
from pdserve.model.errors import ConfigError
from pdserve.model.parallel import WorkerLayout, rows_per_rank
from pdserve.model.weight_names import WeightSpec, checkpoint_weights

__all__ = [
    "DERIVED_GROUPS",
    "EP_RECV_CAPACITY_FACTOR",
    "GIB",
    "GPU_MEMORY_UTILIZATION",
    "GROUPS",
    "RUNTIME_WORKSPACE_BYTES",
    "check_split",
    "reserve_bytes_per_rank",
    "worker_reserve_bytes",
    "weight_bytes_per_rank",
]

GIB = 1 << 30

GPU_MEMORY_UTILIZATION = 0.90
"""Share of each GPU's memory a worker uses in all (weights, reserve, KV), as vLLM's gpu_memory_utilization:
`pdserve plan`'s default, and the bound a worker's ranks size their KV cache under at startup. The other tenth
is what no plan can count in advance: NCCL's buffers (allocated at a group's first collectives, after the
cache), the CUDA graphs' private pools, allocator fragmentation: several GiB on each GPU of a large
expert-parallel decode worker."""

RUNTIME_WORKSPACE_BYTES = 2 * GIB
"""Per-rank memory outside the weights, the KV cache and the activations the plan counts: the CUDA context (about
0.5 GiB, on the GPU but outside torch's allocator), NCCL communicator buffers, cuBLAS and Triton workspaces, the
private memory pools of captured CUDA graphs, and allocator fragmentation. A fixed allowance: none of these can be
known before the process runs, and a plan that leaves less would fail at the first graph capture."""

EP_RECV_CAPACITY_FACTOR = 2.0
"""Expert-parallel receive buffers hold this many times the balanced load (each rank's T * top_k token copies
spread evenly over the ranks): routing is never perfectly balanced, and the buffers have a fixed capacity (CUDA
graphs replay fixed addresses), so they must hold the busiest rank's share."""

GROUPS = (
    "embedding + lm_head",
    "attention",
    "dense MLP",
    "shared experts",
    "routed experts",
    "router",
    "norms, MTP eh_proj",
)
"""Weight groups of checkpoint tensors, in table order."""
DERIVED_GROUPS = ("absorbed wkv_b copy", "stacking padding", "spare expert slots")
"""Weight groups the model allocates beyond the checkpoint's tensors."""


def weight_bytes_per_rank(
    args: ModelArgs, dtype: torch.dtype, layout: WorkerLayout, num_mtp: int
) -> dict[str, int]:
    """Bytes of the weights one rank holds, by group (GROUPS, then DERIVED_GROUPS)."""
    specs = _checkpoint_weights(args, num_mtp)
    out = dict.fromkeys(GROUPS + DERIVED_GROUPS, 0)
    fp8 = args.quantization is not None
    last_part_end: dict[str, int] = {}
    for spec in specs:
        if spec.rows is not None and spec.expert is None:
            last_part_end[spec.param] = max(last_part_end.get(spec.param, 0), spec.rows[1])
    for spec in specs:
        shape = _rank_shape(spec, args, layout)
        if shape is None:
            continue
        quantized = fp8 and spec.quantizable and spec.official_fp8
        itemsize = 1 if quantized else 4 if spec.keep_fp32 else dtype.itemsize
        nbytes = math.prod(shape) * itemsize
        if quantized:
            nbytes += math.ceil(shape[0] / QUANT_BLOCK) * math.ceil(shape[1] / QUANT_BLOCK) * 4
        out[_group(spec)] += nbytes
        if (
            spec.expert == 0 and not spec.is_mtp
        ):  # each main MoE layer's spare slots, one expert each
            out["spare expert slots"] += layout.spare_slots * nbytes
        if (
            spec.rows is not None
            and spec.expert is None
            and spec.rows[1] < last_part_end[spec.param]
        ):
            # stacked parts start on quant-block boundaries: the rows up to the next part are zeros
            pad_rows = -shape[0] % QUANT_BLOCK
            out["stacking padding"] += pad_rows * shape[1] * itemsize
        if quantized and spec.name.endswith("kv_b_proj.weight"):
            # absorbed decode attention multiplies by W_UK / W_UV in the activation dtype, dequantized once
            out["absorbed wkv_b copy"] += math.prod(shape) * dtype.itemsize
    return out


def reserve_bytes_per_rank(
    args: ModelArgs, dtype: torch.dtype, layout: WorkerLayout, step_tokens: int, max_running: int
) -> dict[str, int]:
    """Memory one rank keeps besides its weights and KV cache, by purpose.

    With T = `step_tokens` (the most tokens one forward pass on the rank runs), a = the activation dtype's bytes,
    d = hidden_size, H = heads on the rank, k = num_experts_per_tok, m = moe_intermediate_size, i and s = the dense
    MLP's and the shared experts' intermediate width on the rank, V = vocab_size, R = `max_running` (the most
    sequences in a step):

        activations = a*T*(3d + H*(qk_head_dim + qk_nope_head_dim + 2*v_head_dim + kv_lora_rank + rope_dim)
                           + max(3i, k*(d + 3m) + 3s)) + 4*R*V
          one layer's working set (buffers are reused layer to layer): the hidden state, residual and layer
          output; per head the query, the expanded k_nope|v of prefill, the output and the absorbed query; the
          wider of the dense MLP (gate|up and their product) and the MoE (each token's k permuted copies with
          their expert gate|up and product, plus the shared expert); and fp32 logits for R rows.
        prefix attention block = a*(B*(H*(qk_head_dim + v_head_dim) + kv_lora_rank + rope_dim) + T*H*v_head_dim)
          a prefill chunk's attention to its cached prefix, B = PREFIX_BLOCK_TOKENS keys at a time (fewer where
          the model's context is shorter): the gathered latents, their per-head keys and values, and the
          block's output before it merges into the chunk's.
        EP dispatch buffers = 2 * (1 + EP_RECV_CAPACITY_FACTOR) * T*k*d*a   (when EP > 1)
          dispatch and combine, each a send buffer of T*k token copies and a receive buffer of
          EP_RECV_CAPACITY_FACTOR times the balanced load.
        RoPE table = max_position_embeddings * rope_dim * 4   (fp32 cos/sin for every position)
        CUDA graphs, NCCL, workspace = RUNTIME_WORKSPACE_BYTES
    """
    a, d = dtype.itemsize, args.hidden_size
    t = step_tokens
    heads = args.num_attention_heads // layout.attention_tp_size
    k, m = args.num_experts_per_tok, args.moe_intermediate_size
    dense_i = args.intermediate_size // layout.dense_tp_size if args.first_k_dense_replace else 0
    has_moe = args.first_k_dense_replace < args.num_hidden_layers
    shared_i = args.n_shared_experts * m // layout.dense_tp_size
    moe_width = k * (d + 3 * m) + 3 * shared_i if has_moe else 0
    per_head = args.qk_head_dim + args.qk_nope_head_dim + 2 * args.v_head_dim + args.kv_cache_dim
    activations = a * t * (3 * d + heads * per_head + max(3 * dense_i, moe_width))
    activations += 4 * max_running * args.vocab_size
    block = min(PREFIX_BLOCK_TOKENS, args.max_position_embeddings)
    prefix_block = a * (
        block * (heads * (args.qk_head_dim + args.v_head_dim) + args.kv_cache_dim)
        + t * heads * args.v_head_dim
    )
    ep_buffers = 0
    if layout.expert_parallel > 1 and has_moe:
        ep_buffers = int(2 * (1 + EP_RECV_CAPACITY_FACTOR) * t * k * d * a)
    return {
        "activations": activations,
        "prefix attention block": prefix_block,
        "EP dispatch buffers": ep_buffers,
        "RoPE table": args.max_position_embeddings * args.qk_rope_head_dim * 4,
        "CUDA graphs, NCCL, workspace": RUNTIME_WORKSPACE_BYTES,
    }


def worker_reserve_bytes(
    model, max_num_batched_tokens: int, max_running: int | None, num_drafts: int = 0
) -> int:
    """`reserve_bytes_per_rank` summed for a loaded model (`Transformer`, its `ParallelLayout`) and a role's step
    bounds: what a rank leaves free beside its KV cache at startup, so that the cache `pdserve plan` prints is
    the one the worker takes and the largest step still finds its activations and exchange buffers. A decode
    worker's `max_running` is shared by its data-parallel ranks; a prefill worker has no running batch (None),
    and its logits rows are counted as `pdserve plan`'s default of 256. A worker that speculates
    (`num_drafts`) runs its requests' drafts as rows too (up to `MAX_GRAPH_ROWS`) and keeps, per request, the
    draft distributions of its sampled requests twice over (the draft graphs' output and the runner's copy:
    fp32 [num_drafts, vocab] each)."""
    layout = model.layout.worker
    rows = 256 if max_running is None else rows_per_rank(max_running, layout.attention_dp_size)
    requests = rows
    if num_drafts:
        rows = max(rows, min(MAX_GRAPH_ROWS, rows * (1 + num_drafts)))
    step_tokens = max(max_num_batched_tokens, rows)
    spec = 2 * num_drafts * min(requests, MAX_GRAPH_ROWS) * model.args.vocab_size * 4
    return spec + sum(
        reserve_bytes_per_rank(model.args, model.dtype, layout, step_tokens, rows).values()
    )


@functools.lru_cache(maxsize=4)
def _checkpoint_weights(args: ModelArgs, num_mtp: int) -> tuple[WeightSpec, ...]:
    """checkpoint_weights, kept: a shortfall's advice plans several layouts of one model (47k specs for V3)."""
    return tuple(checkpoint_weights(args, num_mtp))


def check_split(args: ModelArgs, layout: WorkerLayout) -> None:
    if args.n_routed_experts % layout.expert_parallel:
        raise ConfigError(
            f"EP {layout.expert_parallel}: must divide n_routed_experts={args.n_routed_experts}"
        )
    if args.num_attention_heads % layout.attention_tp_size:
        raise ConfigError(
            f"attention TP {layout.attention_tp_size}: must divide "
            f"num_attention_heads={args.num_attention_heads}"
        )
    tp = layout.dense_tp_size
    for name, width in (
        ("intermediate_size", args.intermediate_size),
        ("the shared experts' width", args.n_shared_experts * args.moe_intermediate_size),
    ):
        if width % tp:
            raise ConfigError(f"dense TP {tp}: must divide {name}={width}")


def _split(spec: WeightSpec, args: ModelArgs, dim: int, parts: int) -> tuple[int, ...]:
    shape = list(spec.shape)
    shape[dim] //= parts
    quantized = args.quantization is not None and spec.quantizable and spec.official_fp8
    if parts > 1 and quantized and shape[dim] % QUANT_BLOCK:
        raise ConfigError(
            f"{spec.name}: split {parts} ways, {shape[dim]} per rank is not a multiple of the "
            f"{QUANT_BLOCK}-wide quant block, so fp8 scales would span ranks"
        )
    return tuple(shape)


def _rank_shape(spec: WeightSpec, args: ModelArgs, layout: WorkerLayout) -> tuple[int, ...] | None:
    """The shape of the part of `spec` rank 0 holds (every rank holds the same amount); None: none of it."""
    name = spec.name
    if spec.expert is not None:
        experts_per_rank = args.n_routed_experts // layout.expert_parallel
        return spec.shape if spec.expert < experts_per_rank else None
    attn_tp, dense_tp = layout.attention_tp_size, layout.dense_tp_size
    if name.endswith(("self_attn.q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight")):
        return _split(spec, args, 0, attn_tp)
    if name.endswith("self_attn.o_proj.weight"):
        return _split(spec, args, 1, attn_tp)
    if ".mlp." in name and ".mlp.gate." not in name:  # the dense MLP or the shared experts
        return _split(spec, args, 1 if name.endswith("down_proj.weight") else 0, dense_tp)
    return spec.shape


def _group(spec: WeightSpec) -> str:
    name = spec.name
    if name.endswith(("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")):
        return "embedding + lm_head"
    if ".self_attn." in name:
        return "attention"
    if spec.expert is not None:
        return "routed experts"
    if ".mlp.shared_experts." in name:
        return "shared experts"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense MLP"
    return "norms, MTP eh_proj"
