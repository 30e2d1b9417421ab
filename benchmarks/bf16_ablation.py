"""Where the bf16 model loses accuracy against the fp32 reference, on CPU with the torch reference kernels.

Makes (or reuses) a v2-lite-shape random checkpoint cut to --layers layers, runs the fp32 reference path over a
prompt and a few greedy decode steps (recording its expert choices), then the bf16 model fed the same tokens and
routing, with chosen parts run in fp32 instead: `--fp32 attn,ffn,head` (each part's input is still the bf16
output of its norm; its output goes on in fp32 into the fp32 residual stream). Prints the relative L2 error of
the logits, max and median over the steps, as tests/model/test_triton_model.py measures it on a GPU.

    python benchmarks/bf16_ablation.py --layers 1 --fp32 attn,ffn
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
from test_triton_model import relative_l2, routing  # noqa: E402

from pdserve.kernels import use_backend  # noqa: E402
from pdserve.model.batch import SeqChunk, build_forward_batch  # noqa: E402
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache  # noqa: E402
from pdserve.model.loader import load_model  # noqa: E402
from pdserve.model.random_checkpoint import make_checkpoint  # noqa: E402

PAGE = 16
PARTS = ("attn", "ffn", "head")


def run(
    model, prompt: list[int], steps: int, fed: list[int] | None, device: str = "cpu"
) -> tuple[list[int], torch.Tensor]:
    """Prefill, then `steps` decode steps (fed tokens, or greedy); logits [1 + steps, V] fp32."""
    pages = list(range(-(-(len(prompt) + steps + 1) // PAGE)))
    layout = KVCacheLayout.for_model(model.args, PAGE, model.dtype, model.num_mtp)
    cache = PagedKVCache(layout, len(pages), device)
    batch = build_forward_batch([SeqChunk(prompt, 0, pages)], PAGE, device, decode=False)
    logits = [model.compute_logits(model(batch, cache)[batch.logits_indices])[0]]
    tokens = []
    for i in range(steps):
        tokens.append(fed[i] if fed is not None else int(logits[-1].argmax()))
        batch = build_forward_batch(
            [SeqChunk([tokens[-1]], len(prompt) + i, pages)], PAGE, device, decode=True
        )
        logits.append(model.compute_logits(model(batch, cache))[0])
    return tokens, torch.stack(logits)


def cut_checkpoint(directory: str, layers: int) -> Path:
    """The v2-lite-shape random checkpoint cut to `layers` layers under `directory`, made on first use."""
    path = Path(directory) / f"v2-lite-shape-{layers}"
    if not path.exists():
        make_checkpoint(path, "v2-lite-shape", layers=layers, dtype="bf16")
    return path


def random_prompt(vocab: int, length: int) -> list[int]:
    """The prompt both scripts feed: token 0, then seeded random ids past the special tokens."""
    gen = torch.Generator().manual_seed(0)
    return [0, *torch.randint(3, vocab, (length - 1,), generator=gen).tolist()]


def in_dtype(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Runs `module` in `dtype`: its weights converted (exact from bf16) and its input cast on entry."""
    module.to(dtype)
    forward = module.forward
    module.forward = lambda x, *rest: forward(x.to(dtype), *rest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=8, help="decode steps")
    ap.add_argument(
        "--fp32", default="", help=f"comma-separated parts to run in fp32: {', '.join(PARTS)}"
    )
    ap.add_argument(
        "--dir", default="/tmp/pdserve-bf16-ablation", help="where the checkpoints are kept"
    )
    args = ap.parse_args()
    fp32 = {p for p in args.fp32.split(",") if p}
    if fp32 - set(PARTS):
        ap.error(f"--fp32: unknown parts {sorted(fp32 - set(PARTS))}; expected {', '.join(PARTS)}")
    path = cut_checkpoint(args.dir, args.layers)
    start = time.time()
    routes: list[torch.Tensor] = []
    with use_backend("ref"):
        ref = load_model(path, "cpu", torch.float32, progress=False)
        prompt = random_prompt(ref.args.vocab_size, args.prompt)
        with routing("record", routes):
            tokens, expected = run(ref, prompt, args.steps, None)
        del ref
        model = load_model(path, "cpu", torch.bfloat16, progress=False)
        for layer in model.layers:
            for part, module in (("attn", layer.attn), ("ffn", layer.ffn)):
                in_dtype(module, torch.float32 if part in fp32 else torch.bfloat16)
        if "head" in fp32:
            model.norm.float()
        in_dtype(model.head, torch.float32 if "head" in fp32 else torch.bfloat16)
        with routing("replay", routes):
            _, got = run(model, prompt, args.steps, tokens)
    err = relative_l2(got, expected)
    print(
        f"layers={args.layers} prompt={args.prompt} steps={args.steps} fp32={','.join(sorted(fp32)) or '-'}: "
        f"relative L2 max {err.max():.2e} median {err.median():.2e} ({time.time() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
