"""The whole model on a GPU with the Triton kernels in bf16 against the fp32 reference path: over a 256-token
prompt and 32 decode steps the logits stay within 1e-2 relative L2 at every step.

Both runs read the same checkpoint (bf16 weights; the reference upcasts them to fp32 and runs the torch
references) and are fed the same tokens (the reference's greedy choices). They are also fed the same routing
decisions: the reference records each MoE layer's chosen experts and the bf16 run uses them, with weights from its
own router scores. Random router weights leave near-ties between expert scores, and bf16 rounding flips some of
them: one flipped group or expert changes that step's logits by 10-40%, which says nothing about the kernels. The
free-running comparison (routing not pinned) is printed too, with the steps where routing flipped.

The v2-lite-shape case makes a ~31 GB random checkpoint on the GPU host (or reuses $PDSERVE_V2LITE_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _pinned import relative_l2, routing
from _pinned import run_logits as run_steps

from pdserve.kernels import use_backend
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint

PROMPT_LEN, DECODE_STEPS = 256, 32


def run_logits(model, prompt: list[int], steps: list[int] | None, kv_cache_dtype: str = "auto"):
    return run_steps(model, prompt, steps, DECODE_STEPS, kv_cache_dtype=kv_cache_dtype)


def reference_run(path: Path) -> tuple[list[int], list[int], torch.Tensor, list[torch.Tensor]]:
    """The fp32 reference path on the torch kernels over a random prompt, greedy: the prompt, the tokens it
    chose, its logits and its routing (every moe_route call's expert ids)."""
    g = torch.Generator().manual_seed(0)
    routes: list[torch.Tensor] = []
    with use_backend("ref"):
        ref_model = load_model(path, "cuda", torch.float32, progress=False)
        prompt = [
            0,
            *torch.randint(3, ref_model.args.vocab_size, (PROMPT_LEN - 1,), generator=g).tolist(),
        ]
        with routing("record", routes):
            tokens, expected = run_logits(ref_model, prompt, None)
    del ref_model
    torch.cuda.empty_cache()
    return prompt, tokens, expected, routes


def check(path: Path) -> float:
    """Max over steps of the relative L2 with routing pinned; prints the free-running figures as well."""
    prompt, tokens, expected, ref_routes = reference_run(path)
    free_routes: list[torch.Tensor] = []
    model = load_model(path, "cuda", torch.bfloat16, progress=False)
    with use_backend("triton"):
        with routing("record", free_routes):
            _, free = run_logits(model, prompt, tokens)
        with routing("replay", ref_routes):
            _, pinned = run_logits(model, prompt, tokens)
    with use_backend("ref"), routing("replay", ref_routes):
        _, torch_bf16 = run_logits(model, prompt, tokens)  # the floor of bf16 activations
    per_call = len(ref_routes) // (1 + DECODE_STEPS)
    flipped = [
        step for step in range(1 + DECODE_STEPS)
        if any(not torch.equal(a.sort(-1).values.cpu(), b.sort(-1).values.cpu())
               for a, b in zip(ref_routes[step * per_call : (step + 1) * per_call],
                               free_routes[step * per_call : (step + 1) * per_call], strict=True))
    ]  # fmt: skip
    free_err, pinned_err = relative_l2(free, expected), relative_l2(pinned, expected)
    floor = relative_l2(torch_bf16, expected)
    print(
        f"{path.name}: pinned routing max {pinned_err.max():.2e} (median {pinned_err.median():.2e}); "
        f"torch reference kernels in bf16, pinned: max {floor.max():.2e} (median {floor.median():.2e}); "
        f"free running max {free_err.max():.2e}, routing differs from the reference at steps {flipped}"
    )
    return pinned_err.max().item()


def bf16_checkpoint(tmp_path: Path, preset: str) -> Path:
    """A random bf16 checkpoint: tiny, or v2-lite-shape (made on the GPU, or $PDSERVE_V2LITE_DIR)."""
    if preset == "v2-lite-shape" and os.environ.get("PDSERVE_V2LITE_DIR"):
        return Path(os.environ["PDSERVE_V2LITE_DIR"])
    device = "cpu" if preset == "tiny" else "cuda"
    return make_checkpoint(tmp_path / preset, preset, dtype="bf16", device=device, progress=False)


@pytest.mark.gpu
def test_tiny_triton_bf16_matches_fp32_reference(tmp_path):
    assert check(bf16_checkpoint(tmp_path, "tiny")) <= 1e-2


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="1e-2 is below bf16's floor on this random checkpoint: 1.79e-2 here, torch's own reference kernels "
    "in bf16 1.72e-2 in the same run, HF transformers' bf16 2.74e-2 (the target was closed as blocked)",
)
def test_v2_lite_shape_triton_bf16_matches_fp32_reference(tmp_path):
    assert check(bf16_checkpoint(tmp_path, "v2-lite-shape")) <= 1e-2


@pytest.mark.gpu
def test_tiny_fp8_triton_matches_torch_reference_kernels(tmp_path):
    """The fp8 checkpoint through the Triton path (norms, silu_mul and W_UV's product quantizing for the fp8
    projections, stacked GEMMs on their output) against the torch reference kernels on the same bf16 model, routing and
    tokens pinned to the reference run. Both quantize activations at the same points, but where the two
    bf16 values before a quantization differ, some land on the other side of an e4m3 rounding boundary and
    move by a whole e4m3 step (12.5%): the runs differ by 5.5e-2 at most (H200, also before the norms and
    silu_mul quantized). A wrong scale layout or a misplaced stacked part moves the logits by O(1).
    Bound: 1e-1."""
    # v_head_dim 128 (tiny's is 32) so that W_UV's product quantizes for wo, as in DeepSeek-V3
    path = make_checkpoint(
        tmp_path / "tiny-fp8", "tiny", dtype="fp8", overrides={"v_head_dim": 128}, progress=False
    )
    g = torch.Generator().manual_seed(1)
    model = load_model(path, "cuda", torch.bfloat16, progress=False)
    prompt = [0, *torch.randint(3, model.args.vocab_size, (PROMPT_LEN - 1,), generator=g).tolist()]
    routes: list[torch.Tensor] = []
    with use_backend("ref"), routing("record", routes):
        tokens, expected = run_logits(model, prompt, None)
    with use_backend("triton"), routing("replay", routes):
        _, got = run_logits(model, prompt, tokens)
    err = relative_l2(got, expected)
    print(
        f"tiny fp8: Triton vs torch reference kernels, max {err.max():.2e} (median {err.median():.2e})"
    )
    assert err.max() <= 1e-1


def check_fp8_cache(path: Path) -> float:
    """The Triton bf16 path over fp8 rows against the same path over bf16 rows, both pinned to the fp32
    reference's routing and tokens; returns the max over steps of their relative L2 and prints each one's
    distance to the reference."""
    prompt, tokens, expected, routes = reference_run(path)
    model = load_model(path, "cuda", torch.bfloat16, progress=False)
    with use_backend("triton"), routing("replay", routes):
        _, bf16_rows = run_logits(model, prompt, tokens)
    with use_backend("triton"), routing("replay", routes):
        _, fp8_rows = run_logits(model, prompt, tokens, kv_cache_dtype="fp8")
    between = relative_l2(fp8_rows, bf16_rows)
    to_ref = relative_l2(fp8_rows, expected)
    print(
        f"{path.name}: fp8 rows vs bf16 rows, Triton bf16, pinned: max {between.max():.2e} "
        f"(median {between.median():.2e}); fp8 rows vs the fp32 reference: max {to_ref.max():.2e} "
        f"(median {to_ref.median():.2e}); bf16 rows vs it: max "
        f"{relative_l2(bf16_rows, expected).max():.2e}"
    )
    return between.max().item()


@pytest.mark.gpu
def test_tiny_triton_on_fp8_cache_close_to_bf16_cache(tmp_path):
    """Bound 5e-2 (the CPU test's, tests/model/test_kv_cache_fp8.py)."""
    assert check_fp8_cache(bf16_checkpoint(tmp_path, "tiny")) <= 5e-2


@pytest.mark.gpu
@pytest.mark.slow
def test_v2_lite_shape_triton_on_fp8_cache_close_to_bf16_cache(tmp_path):
    """DeepSeek's latent (kv_lora 512, rope 64), 27 layers."""
    assert check_fp8_cache(bf16_checkpoint(tmp_path, "v2-lite-shape")) <= 5e-2
