"""HF transformers' DeepseekV3 in bf16 against itself in fp32, beside pdserve's bf16 against its fp32
reference, on the same v2-lite-shape random checkpoint: where bf16 arithmetic lands without our code.

Both run on CPU over the same prompt and teacher-forced tokens (the fp32 reference's greedy ones), each
bf16 run with its expert choices pinned to its own fp32 run's. pdserve runs a prefill and decode steps on
its paged cache (torch reference kernels); HF runs the whole sequence at once and its logits are read at
the same positions. Prints the relative L2 of the logits, max and median over the 1 + steps positions,
as tests/model/test_triton_model.py measures it.

    python benchmarks/bf16_hf.py --layers 3
    python benchmarks/bf16_hf.py --checkpoint /tmp/v2l --device cuda --prompt 256 --steps 32
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from pathlib import Path

import torch
from bf16_ablation import cut_checkpoint, random_prompt, run
from test_triton_model import relative_l2, routing  # bf16_ablation puts tests/model on the path

from pdserve.kernels import use_backend
from pdserve.model.loader import load_model


def pin_hf_routing(model, mode: str, log: list[torch.Tensor]) -> None:
    """Wraps every MoE gate of an HF DeepseekV3 model: "record" appends its expert ids to `log`;
    "replay" uses them in order, weighted from this run's router logits as noaux_tc weights them."""
    calls = iter(range(10**9))
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:  # a dense layer
            continue
        original = gate.forward

        def forward(hidden, gate=gate, original=original):
            logits, weights, ids = original(hidden)
            if mode == "record":
                log.append(ids.clone())
                return logits, weights, ids
            ids = log[next(calls)]
            chosen = logits.float().sigmoid().gather(1, ids)
            if gate.norm_topk_prob:
                chosen = chosen / (chosen.sum(-1, keepdim=True) + 1e-20)
            return logits, (chosen * gate.routed_scaling_factor).to(weights.dtype), ids

        gate.forward = forward


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def hf_logits(path, device, dtype, ids: list[int], positions: slice, mode, log) -> torch.Tensor:
    import transformers

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    pin_hf_routing(model, mode, log)
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0, positions].float().cpu()
    del model
    free(device)
    return logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=8, help="decode steps")
    ap.add_argument(
        "--dir", default="/tmp/pdserve-bf16-ablation", help="where the checkpoints are kept"
    )
    ap.add_argument("--checkpoint", help="an existing checkpoint directory (instead of --layers)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args()
    device = args.device
    if args.checkpoint:
        path = Path(args.checkpoint)
    else:
        path = cut_checkpoint(args.dir, args.layers)
    start = time.time()
    ours_routes: list[torch.Tensor] = []
    with use_backend("ref"):
        ref = load_model(path, device, torch.float32, progress=False)
        layers = ref.args.num_hidden_layers
        prompt = random_prompt(ref.args.vocab_size, args.prompt)
        with routing("record", ours_routes):
            tokens, ours_fp32 = run(ref, prompt, args.steps, None, device)
        del ref
        free(device)
        model = load_model(path, device, torch.bfloat16, progress=False)
        with routing("replay", ours_routes):
            _, ours_bf16 = run(model, prompt, args.steps, tokens, device)
        del model
        free(device)
    ours_fp32, ours_bf16 = ours_fp32.cpu(), ours_bf16.cpu()
    # logits at the prompt's last position, then after each fed token
    positions = slice(args.prompt - 1, args.prompt + args.steps)
    seq = prompt + tokens
    hf_routes: list[torch.Tensor] = []
    hf_fp32 = hf_logits(path, device, torch.float32, seq, positions, "record", hf_routes)
    hf_bf16 = hf_logits(path, device, torch.bfloat16, seq, positions, "replay", hf_routes)
    rows = (
        ("pdserve bf16 vs pdserve fp32", ours_bf16, ours_fp32),
        ("HF bf16 vs HF fp32", hf_bf16, hf_fp32),
        ("pdserve fp32 vs HF fp32 (same model?)", ours_fp32, hf_fp32),
    )
    print(
        f"{path} ({layers} layers) on {device}: prompt={args.prompt} steps={args.steps} ({time.time() - start:.0f} s)"
    )
    for name, got, want in rows:
        err = relative_l2(got, want)
        print(f"  {name:40s} relative L2 max {err.max():.2e} median {err.median():.2e}")


if __name__ == "__main__":
    main()
