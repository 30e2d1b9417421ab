"""DeepSeek-V3 in the paper's order: Linear, RMSNorm, YaRN RoPE, MLA, MLP, Gate, Experts, MoE, Block, MTP,
Transformer. All arithmetic goes through `pdserve.kernels` (Triton on GPUs, torch references on CPU). One file
past 500 lines on purpose: the network read top to bottom in the paper's order is its spec.

The forward runs over a packed batch (`ForwardBatch`): T new tokens of B requests, attending through the paged
latent cache (`PagedKVCache`). A prefill batch uses the naive MLA form (latents expanded to per-head keys and
values, causal over the new tokens plus the cached prefix merged by log-sum-exp); a decode batch uses the absorbed
form (W_UK folded into the query, attention directly over cached latents, W_UV applied after). Both write each new
token's latent [c_kv | k_pe] into its cache slot first.

Parameter names follow the DeepSeek reference (`wq_b`, `wkv_b`, `ffn`), except where projections of one input are
stacked into one GEMM: `wqkv_a` holds wq_a (or wq) and wkv_a, `w13` holds w1 and w3. `weight_names.py` maps
checkpoint names to them. Weights are allocated empty; the loader or the random-checkpoint maker fills them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from .. import kernels
from .args import QUANT_BLOCK, ModelArgs, stacked_rows
from .batch import ForwardBatch
from .expert_balance import ExpertBalancer, ExpertRouting, SlotLayout
from .expert_exchange import ExpertExchange, Pending, make_exchange, reduce_tree
from .kv_cache import PagedKVCache
from .parallel import SINGLE_RANK, ParallelLayout
from .shared_expert import FUSED_SHARED_MAX_TOKENS, alias_slot, can_fuse_shared
from .symmetric_exchange import SymmetricBuffers, SymmetricMemoryExchange

IsFp8 = Callable[[str], bool]
"""Given a module path (e.g. 'layers.3.attn.wq_b'), whether its weight is fp8 with block scales."""


def no_fp8(_: str) -> bool:
    return False


SPAN_ATTENTION, SPAN_MLP, SPAN_MOE = "pdserve.attention", "pdserve.mlp", "pdserve.moe"
SPAN_EXCHANGE, SPAN_EXPERTS, SPAN_LOGITS = (
    "pdserve.moe.exchange",
    "pdserve.moe.experts",
    "pdserve.logits",
)
"""torch.profiler ranges of a forward pass (`benchmarks/decode_step_ranks.py --profile` sums the kernels under
each): a layer's attention and its dense MLP or MoE, within an expert-parallel MoE the exchange (dispatch and
combine, waits for the other ranks included) and this rank's experts, and the logits. Outside a profiler a
range costs a few microseconds of host time; CUDA graph replays run none."""


class Linear(nn.Module):
    """y = x W^T without bias. W is bf16/fp32, or float8_e4m3fn with `weight_scale_inv` per 128x128 quant block
    (then the product runs through the FP8 block GEMM, activations quantized in 1x128 groups)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, fp8: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, dtype
        weight_dtype = torch.float8_e4m3fn if fp8 else dtype
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=weight_dtype), False
        )
        if fp8:
            scale_shape = (
                math.ceil(out_features / QUANT_BLOCK),
                math.ceil(in_features / QUANT_BLOCK),
            )
            self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape), requires_grad=False)
        else:
            self.register_parameter("weight_scale_inv", None)

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [..., in_features], or for an fp8 weight the pair (x_fp8 [T, in_features], scales) its producer
        quantized in 1x128 groups (`rmsnorm` / `silu_mul` with quant=True): then no quantization of its own."""
        if isinstance(x, tuple):
            return kernels.scaled_gemm(*x, self.weight, self.weight_scale_inv, self.out_dtype)
        if not self.is_fp8:
            return kernels.linear(x, self.weight)
        y = kernels.fp8_gemm(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv)
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W in `dtype` (dequantized when fp8)."""
        if self.weight_scale_inv is None:
            return self.weight.to(dtype)
        return kernels.dequantize_weight(self.weight, self.weight_scale_inv, dtype)


class StackedLinear(Linear):
    """Projections of one input stacked into one weight, so that one GEMM (and one activation quantization)
    computes them all: `forward` returns each part's output, views into the one product. Parts start on
    128-row boundaries (`stacked_rows`); the rows between them are zero and their outputs are dropped."""

    def __init__(self, in_features: int, parts: tuple[int, ...], dtype: torch.dtype, fp8: bool):
        self.offsets = stacked_rows(parts)
        super().__init__(in_features, self.offsets[-1] + parts[-1], dtype, fp8)
        self.parts = parts
        for start, rows, end in zip(self.offsets, parts, self.offsets[1:], strict=False):
            self.weight.data[start + rows : end].zero_()

    def forward(self, x) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        y = super().forward(x)
        return tuple(y[..., o : o + n] for o, n in zip(self.offsets, self.parts, strict=True))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, quant: bool | str = False
    ):
        """quant: the output quantized for an fp8 Linear, (x_fp8, scales) in place of the tensor;
        "both": (output, (x_fp8, scales))."""
        return kernels.rmsnorm(x, self.weight, self.eps, residual, quant)


def rope_cos_sin(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Per position the R/2 cosines then R/2 sines, [max_position_embeddings, R] fp32, with YaRN applied.

    inv_freq follows YaRN: frequencies whose wavelength is long against the original context are interpolated by
    `factor`, short ones kept, with a linear ramp between the correction dims given by beta_fast / beta_slow
    (rounded outward). The attention factor scales cos and sin.
    """
    dim, base = args.qk_rope_head_dim, args.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    inv_freq = 1.0 / pos_freqs  # [R/2]
    s = args.rope_scaling
    if s is not None:

        def correction_dim(num_rotations: float) -> float:
            wavelength_ratio = s.original_max_position_embeddings / (num_rotations * 2 * math.pi)
            return dim * math.log(wavelength_ratio) / (2 * math.log(base))

        low = max(math.floor(correction_dim(s.beta_fast)), 0)
        high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
        extrapolation = 1 - ramp.clamp(0, 1)  # 1: keep the original frequency
        inv_freq = (inv_freq / s.factor) * (1 - extrapolation) + inv_freq * extrapolation
    positions = torch.arange(args.max_position_embeddings, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, R/2]
    factor = args.rope_attention_factor
    return torch.cat([freqs.cos() * factor, freqs.sin() * factor], dim=-1)


class MLA(nn.Module):
    """Multi-head latent attention. `cache_layer` is this attention's layer in the paged cache. With
    tensor-parallel attention this rank holds `n_heads` = H / tp of the heads (wq_b and wkv_b rows, wo columns)
    and sums wo's partial products over the ranks; the latents come from the replicated wqkv_a."""

    def __init__(
        self, args: ModelArgs, cache_layer: int, dtype: torch.dtype, is_fp8: IsFp8, path: str,
        layout: ParallelLayout = SINGLE_RANK,
    ):  # fmt: skip
        super().__init__()
        self.cache_layer = cache_layer
        self.n_heads = args.num_attention_heads // layout.worker.attention_tp_size
        self.layout = layout if layout.worker.attention_tp_size > 1 else None
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_head_dim, self.softmax_scale = args.v_head_dim, args.softmax_scale
        dim, qk_out = args.hidden_size, self.n_heads * args.qk_head_dim

        def linear(name: str, i: int, o: int) -> Linear:
            return Linear(i, o, dtype, is_fp8(f"{path}.{name}"))

        # wq (or wq_a) and wkv_a read the same x: one stacked GEMM
        q_rows = qk_out if self.q_lora_rank is None else self.q_lora_rank
        self.wqkv_a = StackedLinear(
            dim, (q_rows, args.kv_cache_dim), dtype, is_fp8(f"{path}.wqkv_a")
        )
        if self.q_lora_rank is not None:
            self.q_norm = RMSNorm(self.q_lora_rank, args.rms_norm_eps, dtype)
            self.wq_b = linear("wq_b", self.q_lora_rank, qk_out)
        self.kv_norm = RMSNorm(self.kv_lora_rank, args.rms_norm_eps, dtype)
        kv_b_out = self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        self.wkv_b = linear("wkv_b", self.kv_lora_rank, kv_b_out)
        self.wo = linear("wo", self.n_heads * self.v_head_dim, dim)
        self._wkv_b_dense: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache, cos_sin: torch.Tensor
    ) -> torch.Tensor:
        """x: [T, D], or (x_fp8, scales) from attn_norm for an fp8 wqkv_a."""
        q, kv = self.wqkv_a(x)  # q (or its latent) [T, ...], kv [T, kv_lora + rope]
        num_tokens = q.shape[0]
        if self.q_lora_rank is not None:
            q = self.wq_b(self.q_norm(q, quant=self.wq_b.is_fp8))
        q = q.view(num_tokens, self.n_heads, -1)  # [T, H, nope + rope]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_norm(kv[:, : self.kv_lora_rank])  # [T, kv_lora]
        k_pe = kv[:, self.kv_lora_rank :]  # [T, rope], a view: rope rotates it in place
        if batch.is_decode:
            # the absorbed query [q_nope W_UK | q_pe], [T, H, kv_lora + rope]: rope writes q_pe's
            # rotation into it, the head product the rest (no torch.cat, whose copy of every head's
            # query costs more than the product; no copy of q_pe either)
            q_abs = q.new_empty(num_tokens, self.n_heads, self.kv_lora_rank + self.qk_rope_head_dim)
            # ... and stores k_pe's rotation in the cache with c_kv, in the same launch
            kernels.rope(
                q_pe, k_pe, batch.positions, cos_sin, q_out=q_abs[..., self.kv_lora_rank :],
                cache=(cache.layer(self.cache_layer), batch.slot_mapping, c_kv),
            )  # fmt: skip
            out = self._absorbed(q_nope, q_abs, batch, cache)
            if isinstance(out, tuple):  # quantized for the fp8 wo
                return self._reduce(self.wo(out))
        else:
            kernels.rope(q_pe, k_pe, batch.positions, cos_sin)
            cache.write(self.cache_layer, batch.slot_mapping, c_kv, k_pe)
            out = self._naive(q, c_kv, k_pe, batch, cache)  # q's rope part rotated in place
        return self._reduce(self.wo(out.reshape(num_tokens, self.n_heads * self.v_head_dim)))

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Tensor-parallel attention: this rank's heads gave a partial wo product; sum it over the ranks."""
        return y if self.layout is None else self.layout.all_reduce(y)

    def _expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [N, kv_lora] and rope keys [N, rope] to per-head keys [N, H, 192] and values [N, H, 128]."""
        kv = self.wkv_b(c_kv).view(-1, self.n_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = k_pe[:, None, :].expand(-1, self.n_heads, -1)  # [N, H, rope]
        return torch.cat([k_nope, k_pe], dim=-1), v.contiguous()

    def _naive(self, q, c_kv, k_pe, batch: ForwardBatch, cache: PagedKVCache):
        """q: [T, H, nope + rope] as the projection wrote it (rows may be strided), rope applied."""
        k, v = self._expand(c_kv, k_pe)
        cu_q = batch.cu_seqlens_q
        out, lse = kernels.mla_prefill(q, k, v, cu_q, cu_q, self.softmax_scale, causal=True)
        for block in batch.prefix_blocks:  # the cached prefix, a bounded block at a time
            prefix = cache.gather(self.cache_layer, block.slots)  # [Tb, kv_lora + rope]
            k_p, v_p = self._expand(
                prefix[:, : self.kv_lora_rank].to(q.dtype),
                prefix[:, self.kv_lora_rank :].to(q.dtype),
            )
            del prefix
            out_p, lse_p = kernels.mla_prefill(
                q, k_p, v_p, cu_q, block.cu_seqlens, self.softmax_scale, causal=False
            )
            del k_p, v_p
            out, lse = kernels.merge_attn_states(out, lse, out_p, lse_p)
        return out

    def wkv_b_dense(self) -> torch.Tensor:
        """W_KV_B as [H, nope + v, kv_lora] in the activation dtype (dequantized once when fp8)."""
        if self._wkv_b_dense is None:
            dtype = self.kv_norm.weight.dtype
            w = self.wkv_b.dense_weight(dtype)
            self._wkv_b_dense = w.view(self.n_heads, -1, self.kv_lora_rank)
        return self._wkv_b_dense

    def _absorbed(self, q_nope, q, batch: ForwardBatch, cache: PagedKVCache):
        """q: the [T, H, kv_lora + rope] query buffer with its rope part written; the rest is filled here."""
        w = self.wkv_b_dense()
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]
        kernels.head_matmul(q_nope, w_uk, out=q[..., : self.kv_lora_rank])
        q = q.view(batch.num_seqs, batch.num_queries_per_seq, self.n_heads, -1)  # [B, Q, H, Dk]
        out_latent, _ = kernels.mla_decode(
            q, cache.layer(self.cache_layer), batch.page_table, batch.seq_lens,
            self.softmax_scale, self.kv_lora_rank,
        )  # fmt: skip
        out_latent = out_latent.view(-1, self.n_heads, self.kv_lora_rank)  # [T, H, kv_lora]
        # [T, H, v]; for an fp8 wo the product comes quantized, (x_fp8 [T, H * v], scales), where v is a
        # multiple of the 128-wide quant group (DeepSeek-V3: 128) so that no group spans two heads. From 2
        # rows on that saves wo's own quantization launch; one row's wo quantizes inside its GEMM, which
        # costs less than that launch.
        # Batch-invariant mode takes one path for every batch.
        quant = (
            self.wo.is_fp8
            and self.v_head_dim % QUANT_BLOCK == 0
            and (out_latent.shape[0] > 1 or kernels.batch_invariant())
        )
        return kernels.head_matmul(out_latent, w_uv.transpose(1, 2), quant=quant)


class MLP(nn.Module):
    """Dense SwiGLU feed-forward (also each shared expert): w2(silu(w1 x) * w3 x), w1 and w3 stacked as w13.
    With tensor-parallel dense layers this rank holds inter_dim / tp of the intermediate features (w1 and w3
    rows, w2 columns) and sums w2's partial products over the ranks."""

    def __init__(
        self, dim: int, inter_dim: int, dtype: torch.dtype, is_fp8: IsFp8, path: str,
        layout: ParallelLayout = SINGLE_RANK,
    ):  # fmt: skip
        super().__init__()
        inter_dim //= layout.worker.dense_tp_size
        self.layout = layout if layout.worker.dense_tp_size > 1 else None
        self.w13 = StackedLinear(dim, (inter_dim, inter_dim), dtype, is_fp8(f"{path}.w13"))
        self.w2 = Linear(inter_dim, dim, dtype, is_fp8(f"{path}.w2"))

    def forward(self, x) -> torch.Tensor:
        """x: [T, D], or (x_fp8, scales) from ffn_norm for an fp8 w13."""
        gate, up = self.w13(x)
        # an fp8 down projection takes the activation quantized by silu_mul
        y = self.w2(kernels.silu_mul(gate, up, quant=self.w2.is_fp8))
        return y if self.layout is None else self.layout.all_reduce(y)


class Gate(nn.Module):
    """noaux_tc router: fp32 logits, then `kernels.moe_route` (bias for selection only). The weight has the
    activations' dtype (DeepSeek-V3 ships it in bf16): bf16 products are exact in fp32, so one GEMM with an fp32
    output gives the logits that upcasting both operands would, without the upcast copies or an fp32 GEMM
    (several times slower)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(
            torch.empty(args.n_routed_experts, args.hidden_size, dtype=dtype), False
        )
        self.bias = nn.Parameter(torch.empty(args.n_routed_experts, dtype=torch.float32), False)

    def forward(self, x: torch.Tensor, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """num_shared: shared experts stacked after the routed ones, appended as ids E.. with weight 1."""
        a = self.args
        logits = kernels.linear(x, self.weight, out_dtype=torch.float32)  # [T, E]
        return kernels.moe_route(
            logits, self.bias, a.num_experts_per_tok, a.n_group, a.topk_group,
            a.routed_scaling_factor, a.norm_topk_prob, num_shared,
        )  # fmt: skip


class Experts(nn.Module):
    """The routed experts of one layer, stacked: w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I].
    `extra` more slots after them hold the shared expert when MoE fuses it (`MoE.fused_shared`). With expert
    parallelism E is this rank's share, `ParallelLayout.local_experts`, indexed by local id."""

    def __init__(
        self, args: ModelArgs, dtype: torch.dtype, fp8: bool, extra: int = 0,
        layout: ParallelLayout = SINGLE_RANK,
    ):  # fmt: skip
        super().__init__()
        d, i = args.hidden_size, args.moe_intermediate_size
        e = len(layout.local_experts(args.n_routed_experts)) + extra
        weight_dtype = torch.float8_e4m3fn if fp8 else dtype
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, d, dtype=weight_dtype), False)
        self.w2 = nn.Parameter(torch.empty(e, d, i, dtype=weight_dtype), False)
        if fp8:
            b = QUANT_BLOCK
            self.w13_scale_inv = nn.Parameter(torch.empty(e, 2 * i // b, d // b), False)
            self.w2_scale_inv = nn.Parameter(torch.empty(e, d // b, i // b), False)
        else:
            self.register_parameter("w13_scale_inv", None)
            self.register_parameter("w2_scale_inv", None)

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale_inv is not None

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, x_q=None,
        tree: tuple[int, int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """x_q: x quantized (fp8 experts only), as `kernels.fused_moe` takes it; tree: its sum order (then
        fp32)."""
        with record_function(SPAN_EXPERTS):
            return kernels.fused_moe(
                x, self.w13, self.w2, weights, ids, self.w13_scale_inv, self.w2_scale_inv, x_q, tree
            )


class MoE(nn.Module):
    """Routed experts plus the shared expert(s). With one shared expert laid out like a routed one (DeepSeek-V3),
    it is stored as slot E of the stacked experts (`fused_shared`): small batches run it inside the routed
    experts' launch, as expert E that every token takes with weight 1; larger ones, and batch-invariant mode,
    run it as its own MLP over the same weights.

    Expert-parallel (`exchange` set): the gate routes as on one rank, the exchange carries each (token, slot)
    to the rank holding its expert and the outputs back (`expert_exchange.py`); the shared expert runs on the
    token's home rank as its own MLP.

    Batch-invariant mode sums a token's routed outputs as a tree over `REDUCE_GROUPS` groups of experts
    (`kernels.fused_moe`'s `tree`): each rank of an expert-parallel group sums its own groups' subtree and the
    exchange adds the ranks' subtrees as the tree's top levels, so a token gets the same bits on one GPU and
    on N (N dividing `REDUCE_GROUPS`, the experts a multiple of it)."""

    def __init__(
        self, args: ModelArgs, dtype: torch.dtype, is_fp8: IsFp8, path: str,
        layout: ParallelLayout = SINGLE_RANK, balanced: bool = True,
    ):  # fmt: skip
        super().__init__()
        self.gate = Gate(args, dtype)
        spares = layout.worker.spare_slots if balanced else 0
        self.slots = SlotLayout(args.n_routed_experts, layout.worker.expert_parallel, spares)
        """This layer's expert slots over the expert-parallel group (`expert_balance`)."""
        self.routing: ExpertRouting | None = None
        """The routing to the copies of hot experts in spare slots (None: no spare slots)."""
        experts_or_slots = self.slots.num_slots if spares else args.n_routed_experts
        self.exchange: ExpertExchange | None = make_exchange(layout, experts_or_slots)
        experts_fp8 = is_fp8(f"{path}.experts")
        self.shared_experts = None
        self.fused_shared = False
        if args.n_shared_experts:
            inter = args.moe_intermediate_size * args.n_shared_experts
            self.shared_experts = MLP(
                args.hidden_size, inter, dtype, is_fp8, f"{path}.shared_experts", layout
            )
            self.fused_shared = (
                self.exchange is None
                and layout.worker.dense_tp_size == 1
                and can_fuse_shared(args, self.shared_experts, experts_fp8)
            )
        self.experts = Experts(args, dtype, experts_fp8, int(self.fused_shared) + spares, layout)
        if self.fused_shared:
            alias_slot(self.shared_experts, self.experts, args.n_routed_experts)
        if spares:  # empty until a rebalance copies an expert in, and never routed to before
            self.routing = ExpertRouting(self.slots, self.gate.weight.device)
            for weight in (self.experts.w13, self.experts.w2, self.experts.w13_scale_inv,
                           self.experts.w2_scale_inv):  # fmt: skip
                if weight is not None:
                    weight.data[self.slots.home_per_rank :].zero_()
        self.tree = reduce_tree(args.n_routed_experts, layout.worker.expert_parallel)
        """`kernels.fused_moe`'s tree for this rank's experts in batch-invariant mode (None: slot order)."""

    def forward(
        self, x: torch.Tensor, x_q: tuple[torch.Tensor, torch.Tensor] | None = None,
        counted: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """x_q: x quantized by ffn_norm (quant="both"), for the experts whose weights are fp8; counted [T] bool:
        the rows whose routes count towards the experts' loads (None: all; see `counted_rows`)."""
        if self.exchange is not None:
            return self._forward_expert_parallel(x, x_q, counted)
        expert_x_q = x_q if self.experts.is_fp8 else None
        if self.tree is not None and kernels.batch_invariant():
            weights, ids = self.gate(x)
            y = self.experts(x, weights, ids, expert_x_q, tree=self.tree).to(x.dtype)
            return y if self.shared_experts is None else y + self._shared(x, x_q)
        if (
            self.fused_shared
            and x.shape[0] <= FUSED_SHARED_MAX_TOKENS
            and not kernels.batch_invariant()
        ):
            weights, ids = self.gate(x, num_shared=1)
            return self.experts(x, weights, ids, expert_x_q)
        weights, ids = self.gate(x)
        y = self.experts(x, weights, ids, expert_x_q)
        if self.shared_experts is None:
            return y
        return y + self._shared(x, x_q)

    def _shared(self, x, x_q) -> torch.Tensor:
        shared_q = x_q is not None and self.shared_experts.w13.is_fp8
        return self.shared_experts(x_q if shared_q else x)

    def _forward_expert_parallel(self, x: torch.Tensor, x_q, counted=None) -> torch.Tensor:
        """Collective over the expert-parallel group: every rank calls it, with zero tokens too."""
        state = self.ep_start(x, x_q, counted)
        self.ep_experts(state)
        return self.ep_finish(state)

    def ep_start(self, x: torch.Tensor, x_q, counted=None, overlap: bool = False) -> _EPState:
        """The expert-parallel forward in three stages (`ep_start`, `ep_experts`, `ep_finish`, each collective
        stage called by every rank in the same order), so that a caller can run other work while an exchange
        is in flight (`overlap`: the dispatch and the combine are left in flight where the exchange can).
        This one: the gate, the routing to expert slots and the dispatch."""
        weights, ids = self.gate(x)  # [T, k] each
        if self.routing is not None:  # expert ids -> the slots of their copies
            ids = self.routing.route(ids, counted, home_only=kernels.batch_invariant())
        # fp8 experts: x travels quantized (as their GEMM takes it), or in the activation dtype to be quantized
        # there (layout.dispatch_fp8 off); every rank sends the same kind of message
        if self.experts.is_fp8 and x_q is None and x.shape[0]:
            x_q = kernels.quantize_act(x)
        sent_q = x_q if self.experts.is_fp8 else None
        with record_function(SPAN_EXCHANGE):
            if overlap:
                pending = self.exchange.dispatch_async(x, ids, weights, sent_q)
            else:
                pending = Pending.done(self.exchange.dispatch(x, ids, weights, sent_q))
        return _EPState(x, x_q, pending, overlap)

    def ep_experts(self, state: _EPState) -> None:
        """Waits for the dispatch, runs this rank's experts over the rows it brought and starts the combine."""
        with record_function(SPAN_EXCHANGE):
            local, handle = state.pending.wait()
        x, tree = state.x, self.tree if kernels.batch_invariant() else None
        if local.num_rows:
            y = self._local_experts(local, x, tree)
        else:  # every rank sends the same dtype: fp32 subtrees in the tree's mode
            y = local.x.new_empty(0, x.shape[1], dtype=x.dtype if tree is None else torch.float32)
        with record_function(SPAN_EXCHANGE):
            if state.overlap:
                state.pending = self.exchange.combine_async(y, handle, tree=tree is not None)
            else:
                out = self.exchange.combine(y, handle, tree=tree is not None)  # [T, D]
                state.pending = Pending.done(out)

    def ep_finish(self, state: _EPState) -> torch.Tensor:
        """Waits for the combine and adds the shared expert: the layer's output [T, D]."""
        with record_function(SPAN_EXCHANGE):
            out = state.pending.wait()
        if self.shared_experts is None:
            return out
        return out + self._shared(state.x, state.x_q)

    def _local_experts(self, local, x: torch.Tensor, tree) -> torch.Tensor:
        """This rank's experts over the exchanged rows (`ExpertBatch`), `layout.expert_chunk_tokens` rows a
        launch; a token's output does not depend on the chunk it runs in."""
        n, chunk = local.num_rows, self.exchange.layout.expert_chunk_tokens
        y = None
        for start in range(0, n, chunk):
            part = slice(start, min(n, start + chunk))
            rows = local.x
            if rows is None:  # fused_moe reads x_q and only the shape and dtype of x
                rows = x.new_empty(part.stop - start, x.shape[1])
            else:
                rows = rows[part]
            x_q = None if local.x_q is None else (local.x_q[0][part], local.x_q[1][part])
            out = self.experts(rows, local.topk_weights[part], local.topk_ids[part], x_q, tree=tree)
            if n <= chunk:
                return out
            if y is None:
                y = out.new_empty(n, out.shape[1])
            y[part] = out
        return y

    def join_idle(self) -> None:
        """Takes part in this layer's exchange with no tokens (a data-parallel rank with no requests)."""
        assert self.exchange is not None
        self._forward_expert_parallel(*self.no_tokens())

    def no_tokens(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(x, x_q) of zero tokens, as `ep_start` takes them: the same message layout as the ranks with tokens
        send."""
        dim = self.gate.weight.shape[1]
        x = self.gate.weight.new_empty(0, dim)
        if not self.experts.is_fp8:
            return x, None
        return x, (
            x.new_empty(0, dim, dtype=torch.float8_e4m3fn),
            x.new_empty(0, -(-dim // 128), dtype=torch.float32),
        )


@dataclasses.dataclass
class _EPState:
    """An expert-parallel MoE forward between its stages (`MoE.ep_start`)."""

    x: torch.Tensor
    x_q: tuple[torch.Tensor, torch.Tensor] | None
    pending: Pending
    """The dispatch in flight (then `ExpertBatch`, handle), later the combine (then [T, D])."""
    overlap: bool


class Block(nn.Module):
    """Pre-norm transformer layer; carries the residual stream separately so norms can fuse the add. The
    residual stream is fp32 whatever the activation dtype: 60 layers of bf16 sums would cost more accuracy than
    its bytes are worth."""

    def __init__(
        self,
        args: ModelArgs,
        layer: int,
        cache_layer: int,
        dtype: torch.dtype,
        is_fp8: IsFp8,
        path: str,
        layout: ParallelLayout = SINGLE_RANK,
    ):
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.attn = MLA(args, cache_layer, dtype, is_fp8, f"{path}.attn", layout)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        if args.is_moe_layer(layer):
            # the main layers' experts are balanced; an MTP module's (one layer) keep their home copies
            balanced = layer < args.num_hidden_layers
            self.ffn = MoE(args, dtype, is_fp8, f"{path}.ffn", layout, balanced)
        else:
            self.ffn = MLP(
                args.hidden_size, args.intermediate_size, dtype, is_fp8, f"{path}.ffn", layout
            )
        # A norm whose only reader is an fp8 projection hands it its output quantized (no launch of its own);
        # an MoE layer's norm with fp8 experts (routed or shared) hands out both: the router reads the output.
        self.quant_attn = self.attn.wqkv_a.is_fp8
        self.quant_ffn: bool | str = isinstance(self.ffn, MLP) and self.ffn.w13.is_fp8
        if isinstance(self.ffn, MoE):
            shared = self.ffn.shared_experts
            if self.ffn.experts.is_fp8 or (shared is not None and shared.w13.is_fp8):
                self.quant_ffn = "both"

    def forward(self, x, residual, batch: ForwardBatch, cache: PagedKVCache, cos_sin, counted=None):
        """counted: the rows whose routes an MoE layer counts (`counted_rows`)."""
        h, residual = self.attend(x, residual, batch, cache, cos_sin)
        if isinstance(self.ffn, MoE):
            with record_function(SPAN_MOE):
                if self.quant_ffn == "both":
                    return self.ffn(*h, counted=counted), residual
                return self.ffn(h, counted=counted), residual
        with record_function(SPAN_MLP):
            return self.ffn(h), residual

    def attend(self, x, residual, batch: ForwardBatch, cache: PagedKVCache, cos_sin):
        """The layer up to its MLP or MoE: (the ffn's input, as `ffn_norm` gives it, and the residual)."""
        if residual is None:
            residual, h = x.float(), self.attn_norm(x, quant=self.quant_attn)
        else:
            h, residual = self.attn_norm(x, residual, self.quant_attn)
        with record_function(SPAN_ATTENTION):
            h = self.attn(h, batch, cache, cos_sin)
        return self.ffn_norm(h, residual, self.quant_ffn)

    def moe_input(self, h) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """`attend`'s ffn input as an MoE layer's (x, x_q)."""
        return h if self.quant_ffn == "both" else (h, None)


class MTP(nn.Module):
    """One multi-token-prediction module: from the main model's final (normed) hidden state h_t and the embedding
    of token t+1 it predicts token t+2. Its block attends through its own cache layer at the main model's
    positions (the convention of vLLM and SGLang)."""

    def __init__(
        self, args: ModelArgs, depth: int, dtype: torch.dtype, is_fp8: IsFp8,
        layout: ParallelLayout = SINGLE_RANK,
    ):  # fmt: skip
        super().__init__()
        layer = args.num_hidden_layers + depth
        path = f"mtp.{depth}"
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.embed.weight.requires_grad_(False)
        self.enorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.eh_proj = Linear(
            2 * args.hidden_size, args.hidden_size, dtype, is_fp8(f"{path}.eh_proj")
        )
        self.block = Block(args, layer, layer, dtype, is_fp8, f"{path}.block", layout)
        self.head_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.head = Linear(args.hidden_size, args.vocab_size, dtype, is_fp8(f"{path}.head"))

    def forward(
        self, prev_hidden, next_token_ids, batch: ForwardBatch, cache: PagedKVCache, cos_sin
    ):
        """prev_hidden: [T, D] main-model hidden at positions t; next_token_ids: [T] the tokens at t+1."""
        e = self.enorm(F.embedding(next_token_ids, self.embed.weight))
        x = self.eh_proj(torch.cat([e, self.hnorm(prev_hidden)], dim=-1))  # [T, D]
        x, residual = self.block(x, None, batch, cache, cos_sin)
        return self.head_norm(x, residual)[0]


def counted_rows(batch: ForwardBatch) -> torch.Tensor | None:
    """The rows of `batch` whose routes count towards the experts' loads, [T] bool; None: all. A decode row
    caching fewer than two tokens is padding (the CUDA graphs' padding rows cache one; a real decode token
    follows at least one prompt token), a prefill batch has none."""
    if not batch.is_decode:
        return None
    rows = batch.seq_lens >= 2  # [B]
    return rows[:, None].expand(-1, batch.num_queries_per_seq).reshape(-1)  # [T]


class Transformer(nn.Module):
    """The whole model. `forward` returns final-norm hidden states [T, D]; `compute_logits` applies the head.

    `layout` says which share of the weights this rank holds and which collectives each layer joins
    (`parallel.py`); embedding, norms, router and head are replicated on every rank. With expert parallelism
    every rank runs every step: one with no tokens calls `forward_idle` (and `mtp_idle`) instead."""

    def __init__(
        self, args: ModelArgs, dtype: torch.dtype = torch.bfloat16, is_fp8: IsFp8 = no_fp8,
        num_mtp: int | None = None, layout: ParallelLayout = SINGLE_RANK,
    ):  # fmt: skip
        super().__init__()
        layout.worker.check_model(args)
        self.args, self.dtype, self.layout = args, dtype, layout
        self.num_mtp = args.num_nextn_predict_layers if num_mtp is None else num_mtp
        self.checkpoint_dir: str | None = None
        """The checkpoint this model was loaded from (`load_model` sets it), where the runner finds the
        tokenizer that structured outputs' grammars are matched against; None for a model built in memory."""
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            Block(args, i, i, dtype, is_fp8, f"layers.{i}", layout)
            for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.head = Linear(args.hidden_size, args.vocab_size, dtype, is_fp8("head"))
        self.mtp = nn.ModuleList(MTP(args, j, dtype, is_fp8, layout) for j in range(self.num_mtp))
        self.register_buffer("cos_sin", rope_cos_sin(args), persistent=False)
        balanced = [
            (layer.ffn.routing, layer.ffn.experts)
            for layer in self.layers
            if isinstance(layer.ffn, MoE) and layer.ffn.routing is not None
        ]
        self.balancer = (
            ExpertBalancer(balanced, layout, layout.worker.rebalance_steps) if balanced else None
        )
        """Moves copies of hot experts into the spare slots (`expert_balance`); None without spare slots.
        Its `after_step` is collective: the runner calls it on every rank after every step."""
        self._two_batches = False
        """Set by `step_tokens`: decode passes run as two overlapped micro-batches."""
        symmetric = [e for e in self.exchanges if isinstance(e, SymmetricMemoryExchange)]
        if symmetric:  # one set of symmetric buffers for every layer (they run one after another)
            buffers = SymmetricBuffers(layout)
            for exchange in symmetric:
                exchange.buffers = buffers

    @property
    def num_cache_layers(self) -> int:
        """Layers that cache KV: the main layers, then one per MTP module."""
        return self.args.num_hidden_layers + self.num_mtp

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        with kernels.forward_phase("decode" if batch.is_decode else "prefill"):
            x, residual = F.embedding(batch.input_ids, self.embed.weight), None  # [T, D]
            if self._two_batches and batch.is_decode:  # its first half of requests and the rest
                halves = [batch, None]
                if batch.num_seqs > 1:
                    halves = list(batch.split(-(-batch.num_seqs // 2)))
                return self.forward_micro_batches(halves, cache)
            counted = counted_rows(batch) if self.balancer is not None else None
            for layer in self.layers:
                x, residual = layer(x, residual, batch, cache, self.cos_sin, counted)
            return self.norm(x, residual)[0]

    @torch.inference_mode()
    def forward_micro_batches(
        self, batches: list[ForwardBatch | None], cache: PagedKVCache
    ) -> torch.Tensor:  # fmt: skip
        """`forward` of two micro-batches [a, b] (b None: it joins the exchanges with no tokens), each MoE
        layer's exchange of one in flight while the other computes: a's dispatch beside b's attention, a's
        experts beside b's dispatch, b's experts beside a's combine, a's shared expert beside b's combine.
        Returns a's final hidden states, then b's. Within `step_tokens(n, two_batches=True)`: every rank runs
        it (or `forward_idle`) and each micro-batch holds at most ceil(n / 2) tokens, which its exchanges
        pad to. A token of b may follow a token of a in the same request: a layer writes a's KV before b
        attends."""
        if not self._two_batches or len(batches) != 2 or batches[0] is None:
            raise ValueError(
                "forward_micro_batches: [a, b or None] within step_tokens(two_batches=True)"
            )
        xs = [None if m is None else F.embedding(m.input_ids, self.embed.weight) for m in batches]
        residuals: list = [None, None]
        counted = [None if m is None or self.balancer is None else counted_rows(m) for m in batches]
        phase = kernels.forward_phase("decode" if batches[0].is_decode else "prefill")
        with phase, self._exchanges_padded_to(-(-self.exchanges[0].step_tokens // 2)):
            for layer in self.layers:
                ffn = layer.ffn
                if not (isinstance(ffn, MoE) and ffn.exchange is not None):
                    for i, m in enumerate(batches):
                        if m is not None:
                            xs[i], residuals[i] = layer(xs[i], residuals[i], m, cache, self.cos_sin)
                    continue
                states = []
                for i, m in enumerate(batches):
                    if m is None:
                        x_in = ffn.no_tokens()
                    else:
                        h, residuals[i] = layer.attend(xs[i], residuals[i], m, cache, self.cos_sin)
                        x_in = layer.moe_input(h)
                    with record_function(SPAN_MOE):
                        states.append(ffn.ep_start(*x_in, counted[i], overlap=True))
                with record_function(SPAN_MOE):
                    for state in states:
                        ffn.ep_experts(state)
                    xs = [ffn.ep_finish(state) for state in states]
            out = [
                self.norm(x, r)[0]
                for x, r, m in zip(xs, residuals, batches, strict=True)
                if m is not None
            ]
        return torch.cat(out) if len(out) > 1 else out[0]

    @contextlib.contextmanager
    def _exchanges_padded_to(self, num_tokens: int | None):
        """Within: the exchanges pad to `num_tokens` a rank (None: ask the ranks), as before after."""
        saved = [e.step_tokens for e in self.exchanges]
        for e in self.exchanges:
            e.step_tokens = num_tokens
        try:
            yield
        finally:
            for e, tokens in zip(self.exchanges, saved, strict=True):
                e.step_tokens = tokens

    @property
    def exchanges(self) -> list[ExpertExchange]:
        """The expert exchanges of every MoE layer (MTP's included), in layer order."""
        found = self.__dict__.get("_exchanges")
        if found is None:
            found = [m.exchange for m in self.modules() if isinstance(m, MoE) and m.exchange]
            self.__dict__["_exchanges"] = found
        return found

    @contextlib.contextmanager
    def step_tokens(self, num_tokens: int | None, two_batches: bool = False):
        """Within: every rank holds at most `num_tokens` tokens in each pass (the same number on every rank, as
        a step plan tells it), so the expert exchanges pad to it without asking the other ranks.
        two_batches (the same on every rank; with `num_tokens`, data-parallel attention and the all-gather
        exchange only): the main model's decode passes run as two micro-batches whose exchanges overlap
        the other's compute (`forward_micro_batches`; a rank without rows joins both exchanges), and a
        prefill pass may (the runner splits its tokens)."""
        if two_batches and not self.can_run_two_batches:
            raise ValueError(
                "two micro-batches need data-parallel attention and an overlapping exchange"
            )
        if two_batches and num_tokens is None:
            raise ValueError("two micro-batches need the step's tokens")
        self._two_batches = two_batches
        try:
            with self._exchanges_padded_to(num_tokens):
                yield
        finally:
            self._two_batches = False

    @property
    def two_batches(self) -> bool:
        """Whether this pass runs as two micro-batches (`step_tokens`)."""
        return self._two_batches

    @property
    def can_run_two_batches(self) -> bool:
        """Whether decode passes can run as two overlapped micro-batches (`step_tokens`): ranks with their
        own tokens whose exchanges overlap."""
        exchanges = self.exchanges
        return (
            bool(exchanges)
            and not self.layout.worker.same_tokens_on_all_ranks
            and all(e.overlaps for e in exchanges)
        )

    @torch.inference_mode()
    def forward_idle(self) -> None:
        """A forward step with no tokens: joins each MoE layer's expert exchange, in layer order, as the
        ranks with tokens do in `forward`. Only data-parallel attention leaves a rank without tokens."""
        if not self._two_batches:
            for layer in self.layers:
                if isinstance(layer.ffn, MoE) and layer.ffn.exchange is not None:
                    layer.ffn.join_idle()
            return
        with self._exchanges_padded_to(-(-self.exchanges[0].step_tokens // 2)):
            for layer in self.layers:  # the stages in the order `forward_micro_batches` runs them
                ffn = layer.ffn
                if isinstance(ffn, MoE) and ffn.exchange is not None:
                    states = [ffn.ep_start(*ffn.no_tokens(), overlap=True) for _ in range(2)]
                    for state in states:
                        ffn.ep_experts(state)
                    for state in states:
                        ffn.ep_finish(state)

    @torch.inference_mode()
    def mtp_idle(self, depth: int) -> None:
        """`mtp_logits` of MTP module `depth` with no tokens (see `forward_idle`)."""
        ffn = self.mtp[depth].block.ffn
        if isinstance(ffn, MoE) and ffn.exchange is not None:
            ffn.join_idle()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> logits [N, V] fp32."""
        with record_function(SPAN_LOGITS):
            return self.head(hidden).float()

    @torch.inference_mode()
    def mtp_forward(
        self, depth: int, prev_hidden: torch.Tensor, next_token_ids: torch.Tensor,
        batch: ForwardBatch, cache: PagedKVCache,
    ) -> torch.Tensor:  # fmt: skip
        """MTP module `depth`'s final-norm hidden states [T, D] (`mtp_head` gives their logits): its block
        writes the batch's positions of its cache layer, as `forward` writes the main layers'."""
        with kernels.forward_phase("decode" if batch.is_decode else "prefill"):
            return self.mtp[depth](prev_hidden, next_token_ids, batch, cache, self.cos_sin)

    @torch.inference_mode()
    def mtp_head(self, depth: int, hidden: torch.Tensor) -> torch.Tensor:
        """MTP module `depth`'s logits [N, V] fp32 for hidden states [N, D] it gave."""
        with record_function(SPAN_LOGITS):
            return self.mtp[depth].head(hidden).float()

    @torch.inference_mode()
    def mtp_logits(
        self, depth: int, prev_hidden: torch.Tensor, next_token_ids: torch.Tensor,
        batch: ForwardBatch, cache: PagedKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Runs MTP module `depth`; returns (its hidden [T, D], logits [T, V] fp32 for the token after next)."""
        module = self.mtp[depth]
        hidden = module(prev_hidden, next_token_ids, batch, cache, self.cos_sin)
        return hidden, module.head(hidden).float()
