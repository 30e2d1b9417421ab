"""A differentiable copy of one MTP module, for distilling it (`mtp_distill.py`).

`Transformer`'s forward runs under `torch.inference_mode` through `pdserve.kernels`, whose paths rotate in place,
write the paged cache and quantize activations to fp8: none of it carries gradients. `TrainableMTP` computes the
same function as `MTP.forward` + its head (`Transformer.mtp_logits` over a prefill of whole sequences at
positions 0..S-1) in plain torch over padded [B, S] batches, with fp32 trainable copies of the module's weights
(fp8 ones dequantized) and references to the frozen ones.

Trained: every norm, eh_proj, the attention projections, the router's weight, and the MLP (a dense MTP layer)
or the shared expert(s). Frozen: the embedding and head (copies of the main model's, as DeepSeek-V3 ties them),
the router's correction bias (not a gradient-trained weight in DeepSeek-V3), and the routed experts (on
DeepSeek-V3's shape ~11G parameters: fp32 copies and Adam state would not fit beside the rest; gradients still
flow through them to their inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels.fp8_quant import dequantize_weight
from ..kernels.moe_route.ref import moe_route
from .args import ModelArgs
from .deepseek import Gate, Linear, MoE, RMSNorm, Transformer

FROZEN = ("embed", "head")
"""Modules of an MTP module kept frozen besides the routed experts and the router's bias (see the module doc)."""


def trained_modules(mtp: nn.Module) -> dict[str, nn.Module]:
    """The MTP module's submodules whose weights `TrainableMTP` trains, by path inside the module: every Linear
    but the head, every RMSNorm, every Gate (its weight only); never a routed expert."""
    out = {}
    for path, m in mtp.named_modules():
        if path not in FROZEN and isinstance(m, Linear | RMSNorm | Gate):
            out[path] = m
    return out


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T with a frozen weight of another dtype: under autocast as autocast casts; else in x's dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return x @ w.T
    return x @ w.to(x.dtype).T


class TrainableMTP(nn.Module):
    """MTP module `depth` of `model`, differentiable. `params` maps each trained parameter's path in
    `Transformer` (e.g. "mtp.0.block.attn.wo.weight") to its fp32 master copy on `device`; the frozen tensors
    are the model's own (no copy), so they must stay on `device`."""

    def __init__(
        self, model: Transformer, depth: int = 0, device: torch.device | str | None = None
    ):
        super().__init__()
        if not 0 <= depth < model.num_mtp:
            raise ValueError(f"depth={depth}: the model has {model.num_mtp} MTP module(s)")
        mtp = model.mtp[depth]
        self.args: ModelArgs = model.args
        self.prefix = f"mtp.{depth}."
        device = torch.device(device) if device is not None else model.embed.weight.device
        self.frozen_dtype = model.dtype
        self._masters = nn.ParameterDict()
        self.paths: list[str] = []
        for path, m in trained_modules(mtp).items():
            weight = m.dense_weight(torch.float32) if isinstance(m, Linear) else m.weight.float()
            self._masters[self._key(f"{path}.weight")] = nn.Parameter(weight.to(device).clone())
            self.paths.append(f"{path}.weight")
        block = mtp.block
        self.q_lora = block.attn.q_lora_rank is not None
        self.qkv_parts = (block.attn.wqkv_a.offsets, block.attn.wqkv_a.parts)
        self.eps = self.args.rms_norm_eps
        self.moe = isinstance(block.ffn, MoE)
        ffn_mlp = block.ffn.shared_experts if self.moe else block.ffn
        self.mlp_path = "block.ffn.shared_experts" if self.moe else "block.ffn"
        self.mlp_parts: tuple | None = None
        if ffn_mlp is not None:
            self.mlp_parts = (ffn_mlp.w13.offsets, ffn_mlp.w13.parts)
        # frozen: the model's tensors themselves
        self.embed_weight, self.head_weight = mtp.embed.weight, mtp.head.weight
        self.experts = block.ffn.experts if self.moe else None
        self.gate_bias = block.ffn.gate.bias if self.moe else None
        self.cos_sin = model.cos_sin

    @staticmethod
    def _key(path: str) -> str:
        return path.replace(".", ":")  # ParameterDict keys may not hold dots

    def w(self, path: str) -> torch.Tensor:
        """The master weight at `path` inside the MTP module (without ".weight")."""
        return self._masters[self._key(f"{path}.weight")]

    def trained(self) -> dict[str, torch.Tensor]:
        """Trained weights by their `Transformer` parameter path, fp32, detached."""
        return {self.prefix + p: self.w(p.removesuffix(".weight")).detach() for p in self.paths}

    def _norm(self, x: torch.Tensor, path: str) -> torch.Tensor:
        """RMSNorm as the kernel reference computes it: normalized in fp32, then scaled."""
        h = x.float()
        return self.w(path) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))

    @staticmethod
    def _split(
        y: torch.Tensor, parts: tuple[tuple[int, ...], tuple[int, ...]]
    ) -> list[torch.Tensor]:
        """A StackedLinear's output split into its parts (the padding rows between them dropped)."""
        offsets, sizes = parts
        return [y[..., o : o + n] for o, n in zip(offsets, sizes, strict=True)]

    def forward(self, prev_hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """prev_hidden: [B, S, D] the main model's final-norm hidden at positions 0..S-1; next_ids: [B, S] the
        tokens at positions 1..S. Returns logits [B, S, V] fp32 for the tokens at positions 2..S+1."""
        e = self._norm(F.embedding(next_ids, self.embed_weight), "enorm")
        x = (
            torch.cat([e, self._norm(prev_hidden, "hnorm")], dim=-1) @ self.w("eh_proj").T
        )  # [B, S, D]
        residual = x.float()
        residual = residual + self._attention(self._norm(x, "block.attn_norm"))
        h = self._norm(residual, "block.ffn_norm")
        residual = residual + self._ffn(h.flatten(0, 1)).view_as(h)
        out = self._norm(residual, "head_norm")
        return _matmul(out, self.head_weight).float()

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates interleaved pairs (x[2i], x[2i+1]) as `kernels.rope` does. x: [..., S, *, R]."""
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [..., R/2, 2]
        return out.flatten(-2)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        """Causal MLA in the naive form over [B, S, D] at positions 0..S-1."""
        a = self.args
        bsz, seq, _ = x.shape
        heads = a.num_attention_heads
        q, kv = self._split(x @ self.w("block.attn.wqkv_a").T, self.qkv_parts)
        if self.q_lora:
            q = self._norm(q, "block.attn.q_norm") @ self.w("block.attn.wq_b").T
        q = q.view(bsz, seq, heads, a.qk_head_dim)  # [B, S, H, nope + rope]
        q_nope, q_pe = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        c_kv = self._norm(kv[..., : a.kv_lora_rank], "block.attn.kv_norm")  # [B, S, kv_lora]
        k_pe = kv[..., a.kv_lora_rank :]  # [B, S, rope]
        half = a.qk_rope_head_dim // 2
        cs = self.cos_sin[:seq].float()  # [S, R]
        cos, sin = cs[:, None, :half], cs[:, None, half:]  # [S, 1, R/2]
        q_pe = self._rope(q_pe, cos, sin)  # [B, S, H, rope]
        k_pe = self._rope(k_pe[:, :, None, :], cos, sin)  # [B, S, 1, rope]
        kv_b = c_kv @ self.w("block.attn.wkv_b").T
        kv_b = kv_b.view(bsz, seq, heads, a.qk_nope_head_dim + a.v_head_dim)  # [B, S, H, nope + v]
        k_nope, v = kv_b.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, heads, -1).to(k_nope.dtype)], dim=-1)
        q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, scale=a.softmax_scale,
        )  # fmt: skip  # [B, H, S, v]
        out = out.transpose(1, 2).reshape(bsz, seq, heads * a.v_head_dim)
        return out @ self.w("block.attn.wo").T

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._split(x @ self.w(f"{self.mlp_path}.w13").T, self.mlp_parts)
        return (F.silu(gate) * up) @ self.w(f"{self.mlp_path}.w2").T

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> [N, D]."""
        if not self.moe:
            return self._mlp(x)
        a = self.args
        with torch.autocast(x.device.type, enabled=False):  # fp32 router logits, as the model's
            logits = x.float() @ self.w("block.ffn.gate").float().T  # [N, E]
        weights, ids = moe_route(
            logits, self.gate_bias, a.num_experts_per_tok, a.n_group, a.topk_group,
            a.routed_scaling_factor, a.norm_topk_prob,
        )  # fmt: skip  # [N, k] each
        y = self._routed(x, weights, ids.long())
        return y if self.mlp_parts is None else y + self._mlp(x)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The frozen routed experts (the first n_routed_experts slots; a fused shared expert's slot is never
        routed to). Each expert's output is recomputed in the backward pass rather than kept with its
        dequantized weights."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])
        flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
        for e in torch.unique(flat_ids).tolist():
            rows = (flat_ids == e).nonzero().squeeze(1)
            tokens = token_of[rows]
            if torch.is_grad_enabled():
                y = checkpoint(self._expert, x[tokens], e, use_reentrant=False)
            else:
                y = self._expert(x[tokens], e)
            out = out.index_add(0, tokens, y.float() * flat_weights[rows, None])
        return out

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        ex = self.experts
        w13, w2 = (
            self._frozen(ex.w13[e], ex.w13_scale_inv, e),
            self._frozen(ex.w2[e], ex.w2_scale_inv, e),
        )
        h = _matmul(x, w13)  # [n, 2I]
        inter = h.shape[-1] // 2
        return _matmul(F.silu(h[:, :inter]) * h[:, inter:], w2)

    def _frozen(self, w: torch.Tensor, scale: torch.Tensor | None, e: int) -> torch.Tensor:
        """A routed expert's weight in the activation dtype (dequantized when fp8)."""
        if scale is None:
            return w
        return dequantize_weight(w, scale[e], self.frozen_dtype)
