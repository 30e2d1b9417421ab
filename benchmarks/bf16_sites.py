"""Which bf16 roundings make the bf16 model's logits error: the fp32 model on the torch reference kernels, with
chosen sites' outputs rounded to bf16 (what a bf16 kernel hands on: fp32 math, one rounding of its output).

Sites (a layer has each once unless said): norm_in (attn_norm and ffn_norm outputs, the GEMM inputs), norm_kv,
norm_q, qkv_a, q_b, kv_b (the prefill's expansion), rope (q_pe, k_pe), attn (attention outputs), absorb (the
absorbed-MLA head products), wo, mlp13 / silu / mlp2 (dense layers and the shared experts' activation), sh13 /
sh2 (the shared experts' GEMMs), moe_h / moe_act / moe_y / moe_out (inside the routed experts: gate-up output,
activation, each expert's down output, their weighted sum), moe_sum (routed + shared), final (the last norm),
logits. Configs: `all`, `none`, `all-X` (every site but X), `only-X`, or `a+b+c`. Routing and tokens are pinned
to the unrounded run's, as tests/model/test_triton_model.py pins them; the error is the relative L2 of the
logits over the prompt's last position and the decode steps.

    python benchmarks/bf16_sites.py /tmp/v2l --device cuda              # every all-X and only-X
    python benchmarks/bf16_sites.py /tmp/tiny --device cpu all only-norm_in
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bf16_ablation import random_prompt, run
from test_triton_model import relative_l2, routing  # bf16_ablation puts tests/model on the path

import pdserve.kernels as K
from pdserve.kernels import use_backend
from pdserve.model.deepseek import Linear, MoE, RMSNorm
from pdserve.model.loader import load_model

SITES = [
    "norm_in", "norm_kv", "norm_q", "qkv_a", "q_b", "kv_b", "rope", "attn", "absorb", "wo",
    "mlp13", "silu", "mlp2", "sh13", "sh2", "moe_h", "moe_act", "moe_y", "moe_out", "moe_sum",
    "final", "logits",
]  # fmt: skip
ON: set[str] = set()


def rd(x, site):
    if site in ON and x.dtype == torch.float32:
        return x.to(torch.bfloat16).float()
    return x


def linear_site(name: str) -> str | None:
    parts = name.split(".")
    last = parts[-1]
    if name == "head":
        return "logits"
    if last == "wqkv_a":
        return "qkv_a"
    if last in ("wq_b",):
        return "q_b"
    if last == "wkv_b":
        return "kv_b"
    if last == "wo":
        return "wo"
    if "shared_experts" in parts:
        return "sh13" if last == "w13" else "sh2"
    if last in ("w13", "w2"):
        return "mlp13" if last == "w13" else "mlp2"
    return None


def norm_site(name: str) -> str:
    last = name.split(".")[-1]
    names = {
        "attn_norm": "norm_in",
        "ffn_norm": "norm_in",
        "kv_norm": "norm_kv",
        "q_norm": "norm_q",
    }
    return names.get(last, "final")


def install(model):
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            site = linear_site(name)
            if site is None:
                continue

            def hook(m, inp, out, site=site):
                if isinstance(out, tuple):
                    return tuple(rd(o, site) for o in out)
                return rd(out, site)

            mod.register_forward_hook(hook)
        elif isinstance(mod, RMSNorm):
            site = norm_site(name)

            def hook(m, inp, out, site=site):
                if isinstance(out, tuple):
                    return (rd(out[0], site), *out[1:])
                return rd(out, site)

            mod.register_forward_hook(hook)
        elif isinstance(mod, MoE):

            def hook(m, inp, out):
                return rd(out, "moe_sum")

            mod.register_forward_hook(hook)
    orig = {
        n: getattr(K, n)
        for n in (
            "rope",
            "mla_prefill",
            "mla_decode",
            "merge_attn_states",
            "head_matmul",
            "silu_mul",
        )
    }

    def rope(q_pe, k_pe, positions, cos_sin, q_out=None, cache=None):
        if cache is not None:  # decode: rotate a copy, round it, then store it as rope would
            k_pe = k_pe.clone()
        orig["rope"](q_pe, k_pe, positions, cos_sin, q_out=q_out)
        q = q_pe if q_out is None else q_out  # decode writes the rotation into the absorbed query
        q.copy_(rd(q, "rope"))
        k_pe.copy_(rd(k_pe, "rope"))
        if cache is not None:
            kv_cache, slots, c_kv = cache
            K.write_kv(kv_cache, slots, c_kv, k_pe)

    def attn(n):
        def f(*a, **kw):
            out, lse = orig[n](*a, **kw)
            return rd(out, "attn"), lse

        return f

    def head_matmul(*a, **kw):
        got = orig["head_matmul"](*a, **kw)
        if isinstance(
            got, torch.Tensor
        ):  # written in place when out= is given (the absorbed query)
            got.copy_(rd(got, "absorb"))
        return got

    def silu_mul(*a, **kw):
        return rd(orig["silu_mul"](*a, **kw), "silu")

    def fused_moe(x, w13, w2, topk_weights, topk_ids, *rest):
        inter2 = w13.shape[1]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        flat_ids = topk_ids.reshape(-1).long()
        flat_w = topk_weights.reshape(-1).float()
        token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
        for e in torch.unique(flat_ids).tolist():
            rows = (flat_ids == e).nonzero().squeeze(1)
            tokens = token_of[rows]
            h = rd(x[tokens] @ w13[e].t(), "moe_h")
            act = rd(F.silu(h[:, : inter2 // 2]) * h[:, inter2 // 2 :], "moe_act")
            y = rd(act @ w2[e].t(), "moe_y")
            out.index_add_(0, tokens, y * flat_w[rows, None])
        return rd(out, "moe_out")

    K.rope = rope
    K.mla_prefill = attn("mla_prefill")
    K.mla_decode = attn("mla_decode")
    K.merge_attn_states = attn("merge_attn_states")
    K.head_matmul = head_matmul
    K.silu_mul = silu_mul
    K.fused_moe = fused_moe


def parse(cfg: str) -> set[str]:
    if cfg in ("all", "none"):
        return set(SITES) if cfg == "all" else set()
    names = cfg[4:].split("-") if cfg.startswith("all-") else cfg.removeprefix("only-").split("+")
    unknown = set(names) - set(SITES)
    if unknown:
        raise SystemExit(
            f"bf16_sites: unknown site(s) {sorted(unknown)}; sites: {', '.join(SITES)}"
        )
    return set(SITES) - set(names) if cfg.startswith("all-") else set(names)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint")
    parser.add_argument("configs", nargs="*", help="default: all, then every all-X and only-X")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_intermixed_args()
    configs = args.configs or ["all"] + [f"all-{s}" for s in SITES] + [f"only-{s}" for s in SITES]
    sets = {cfg: parse(cfg) for cfg in configs}
    log: list[torch.Tensor] = []
    with use_backend("ref"):
        model = load_model(args.checkpoint, args.device, torch.float32, progress=False)
        install(model)
        prompt = random_prompt(model.args.vocab_size, args.prompt)
        with routing("record", log):
            tokens, expected = run(model, prompt, args.steps, None, args.device)
        for cfg, sites in sets.items():
            start = time.time()
            ON.clear()
            ON.update(sites)
            with routing("replay", log):
                _, got = run(model, prompt, args.steps, tokens, args.device)
            err = relative_l2(got, expected)
            print(
                f"{cfg:24s} max {err.max():.3e} median {err.median():.3e}  "
                f"({time.time() - start:.1f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
