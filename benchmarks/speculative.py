"""MTP speculation's decode speed against one token a step, and against the byte model's ideal, on one GPU.

    python benchmarks/speculative.py MODEL_DIR [--batch 1,32,64] [--drafts 0,1,2,3] [--acceptance 0.8]
        [--context 1024] [--tokens 64] [--load-format dummy] [--draft oracle|mtp]

Runs the decode worker's loop (the scheduler core and `ModelRunner` with its CUDA graphs) over `batch` requests of
`context` random prompt tokens, each generating `tokens` greedy tokens (EOS ignored), once at one token a step
(K = 0), which gives each request's continuation, then for each K with drafts from:
- `oracle` (benchmarks only, labelled so): the known continuation, each draft replaced by a wrong token with
  probability 1 - acceptance (`OracleDrafter`; the MTP module's passes still run, so a step costs what it would);
- `mtp`: the checkpoint's own MTP module (on random weights its drafts are noise unless it was distilled).
TPOT is the decode steps' wall time (device synchronized; prefill steps excluded) over the tokens after the
first, each configuration run twice and the second timed (the first captures its graphs).

The byte model's ideal speedup for the shape: E = 1 + p + ... + p^K tokens a step at acceptance p, over the
bytes a speculative step reads (the main model at (K + 1) rows a request, K passes of the MTP layer and its head)
relative to a plain step's (the main model at one row a request). Expert bytes count the expected distinct
experts uniform routing touches; KV bytes are read once a request. The same ideal for the 61-layer model is
printed beside it as a projection."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    from pdserve.model.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batch", default="1,32,64")
    parser.add_argument("--drafts", default="0,1,2,3")
    parser.add_argument("--acceptance", type=float, default=0.8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    parser.add_argument(
        "--draft", default="oracle", choices=["oracle", "forced", "mtp"],
        help="oracle: the known continuation, drafts wrong with probability 1 - acceptance (tokens exact "
        "in batch-invariant mode); forced: each draft accepted with probability acceptance whatever its "
        "token (speed alone: the tokens mean nothing); mtp: the checkpoint's MTP module",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--policy", action="store_true",
        help="also each K under the decode worker's default SpecPolicy (drafting off past its batch "
        "limit or below its acceptance floor): rows marked 'auto'",
    )  # fmt: skip
    parser.add_argument(
        "--batch-invariant", action="store_true",
        help="batch-invariant kernels: greedy outputs with drafts must equal K = 0's, request by request",
    )  # fmt: skip
    parser.add_argument(
        "--verify-steps", action="store_true",
        help="also time the verify step alone: a decode step of K + 1 rows a request (no MTP pass) "
        "against one of one row a request, CUDA graphs, median of 20",
    )  # fmt: skip
    args = parser.parse_args()
    if args.batch_invariant:
        from pdserve import kernels

        _contexts.enter_context(kernels.use_batch_invariant())
    torch.manual_seed(0)
    model = load_model(
        args.model, args.device, torch.bfloat16, progress=False, load_format=args.load_format
    )
    drafts = [int(k) for k in args.drafts.split(",")]
    if drafts[0] != 0:
        drafts = [0, *drafts]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    lines = [
        f"{name} | {args.model} ({model.args.num_hidden_layers} layers + {model.num_mtp} MTP) | "
        f"context {args.context}, {args.tokens} tokens | drafts: {args.draft}"
        + (f" (acceptance {args.acceptance})" if args.draft != "mtp" else "")
        + (" | batch-invariant" if args.batch_invariant else ""),
        "| batch | K | TPOT | tokens/step | accepted | speedup | ideal | measured/ideal | "
        "ideal (61 layers) | outputs = K 0's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = [
            torch.randint(3, model.args.vocab_size, (args.context,)).tolist() for _ in range(batch)
        ]
        base = None
        for k in drafts:
            for auto in (False, True) if args.policy and k else (False,):
                run(model, args, prompts, k, base, auto)  # captures this shape's graphs
                result = run(model, args, prompts, k, base, auto)
                if k == 0:
                    base = result
                lines.append(row(model, args, batch, f"{k} auto" if auto else k, result, base))
                print(lines[-1], flush=True)
                _empty()
    if args.verify_steps:
        lines += verify_steps(model, args, [int(b) for b in args.batch.split(",")], drafts)
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "speculative.md").write_text(text + "\n")


def run(model, args, prompts, num_drafts: int, base: dict | None, auto: bool = False) -> dict:
    from pdserve.decode import DecodeConfig
    from pdserve.engine.drafter import OracleDrafter
    from pdserve.engine.pages import PageAllocator, pages_needed
    from pdserve.engine.request import Policy, Request, RequestState
    from pdserve.engine.runner import ModelRunner
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import Scheduler
    from pdserve.engine.spec_policy import SpecPolicy

    batch = len(prompts)
    per_request = pages_needed(args.context + args.tokens + 2 * num_drafts, args.page_size)
    key = ("runner", batch)
    runner = _runners.get(key)
    if runner is None:
        _runners.clear()
        _empty()
        runner = ModelRunner(
            model, args.page_size, batch * (per_request + 1), cuda_graphs=not args.eager
        )
        _runners[key] = runner
    runner.drafter = None
    if num_drafts and args.draft != "mtp":
        sequences = {str(i): p + base["outputs"][i] for i, p in enumerate(prompts)}
        runner.drafter = OracleDrafter(
            model, runner.cache, sequences, args.acceptance, seed=1, forced=args.draft == "forced"
        )
    scheduler = Scheduler(
        PageAllocator(runner.num_pages), args.page_size, 8192, 8192, model.args.vocab_size,
        model.args.max_position_embeddings, model.args.eos_token_ids, max_running=batch,
        num_drafts=num_drafts, spec_policy=SpecPolicy(
            num_drafts, DecodeConfig().speculative_max_batch,
            DecodeConfig().speculative_min_acceptance,
        ) if auto else None,
    )  # fmt: skip
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=0)
    requests = [Request(str(i), list(p), params, Policy.AGGREGATED) for i, p in enumerate(prompts)]
    for r in requests:
        scheduler.add(r)
    decode_s, decode_steps = 0.0, 0
    while any(r.state not in (RequestState.FINISHED, RequestState.ABORTED) for r in requests):
        plan, _ = scheduler.schedule()
        if plan is None:
            raise RuntimeError("nothing to run while requests are live")
        is_decode = not any(s.prefill for s in plan.ranks)
        _sync()
        start = time.perf_counter()
        result = runner.execute(plan)
        _sync()
        if is_decode:
            decode_s += time.perf_counter() - start
            decode_steps += 1
        if result.prefill_error or result.decode_error:
            raise RuntimeError(result.prefill_error or result.decode_error)
        scheduler.finish_step(plan, [result])
    outputs = [r.token_ids[len(p) :] for r, p in zip(requests, prompts, strict=True)]
    drafted = sum(r.num_drafted for r in requests)
    accepted = sum(r.num_accepted for r in requests)
    return {
        "outputs": outputs, "decode_s": decode_s, "steps": decode_steps,
        "tpot_s": decode_s / (args.tokens - 1), "drafted": drafted, "accepted": accepted,
    }  # fmt: skip


def verify_steps(model, args, batches: list[int], drafts: list[int]) -> list[str]:
    """The verify step's time (K + 1 rows a request at consecutive positions, as a verify group runs) against
    a plain step's, through `ModelRunner.execute` with no MTP pass."""
    import statistics

    from pdserve.engine.pages import pages_needed
    from pdserve.engine.runner import ModelRunner
    from pdserve.engine.step import DecodeRow, RankStep, SampleSpec, StepPlan

    out = ["", "| batch | K | verify step | plain step | ratio |", "|---|---|---|---|---|"]
    greedy = SampleSpec(0.0, 1.0, -1, 0.0, 0, 0)
    for batch in batches:
        per = pages_needed(args.context + 2 * max(drafts) + 2, args.page_size)
        _runners.clear()
        _empty()
        runner = ModelRunner(model, args.page_size, batch * per, cuda_graphs=not args.eager)
        tables = [list(range(b * per, (b + 1) * per)) for b in range(batch)]
        times: dict[int, float] = {}
        for k in drafts:
            rows = [
                DecodeRow(str(b), 5, args.context + j, tables[b], greedy, k if j == 0 else 0)
                for b in range(batch) for j in range(k + 1)
            ]  # fmt: skip
            plan = StepPlan(0, [RankStep(decode=rows)])
            samples = []
            for step in range(25):
                _sync()
                start = time.perf_counter()
                runner.execute(plan)
                _sync()
                if step >= 5:
                    samples.append(time.perf_counter() - start)
            times[k] = statistics.median(samples)
            out.append(
                f"| {batch} | {k} | {1e3 * times[k]:.2f} ms | {1e3 * times[drafts[0]]:.2f} ms | "
                f"{times[k] / times[drafts[0]]:.2f}x |"
            )
        runner.close()
    return out


_runners: dict = {}
_contexts = contextlib.ExitStack()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _empty() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def row(model, args, batch: int, k_label, result: dict, base: dict) -> str:
    k = int(str(k_label).split()[0])
    tokens_per_step = (args.tokens - 1) / max(result["steps"], 1)
    accepted = f"{result['accepted'] / result['drafted']:.2f}" if result["drafted"] else "-"
    speedup = base["tpot_s"] / result["tpot_s"]
    p = args.acceptance if args.draft != "mtp" else (
        result["accepted"] / result["drafted"] if result["drafted"] else 0.0
    )  # fmt: skip
    ideal = ideal_speedup(model, batch, k, p, args.context)
    ideal_full = ideal_speedup(model, batch, k, p, args.context, layers=61)
    ratio = f"{speedup / ideal:.2f}" if k else "-"
    same = sum(a == b for a, b in zip(result["outputs"], base["outputs"], strict=True))
    return (
        f"| {batch} | {k_label} | {1e3 * result['tpot_s']:.2f} ms | {tokens_per_step:.2f} | {accepted} | "
        f"{speedup:.2f}x | {ideal:.2f}x | {ratio} | {ideal_full:.2f}x | {same}/{batch} |"
    )


def ideal_speedup(
    model, batch: int, k: int, p: float, context: int, layers: int | None = None
) -> float:
    """The byte model's speedup of K drafts at acceptance p (module docstring)."""
    if k == 0:
        return 1.0
    expected = sum(p**i for i in range(k + 1))
    plain = step_bytes(model, batch, 1, context, layers)
    spec = step_bytes(model, batch, k + 1, context, layers) + k * mtp_bytes(model, batch)
    return expected / (spec / plain)


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _layer_bytes(model, block, tokens: int) -> float:
    """A block's bytes at `tokens` rows: its weights but the routed experts, plus the expected distinct experts
    touched under uniform routing."""
    from pdserve.model.deepseek import Experts

    experts = [m for m in block.modules() if isinstance(m, Experts)]
    skip = {id(p) for m in experts for p in m.parameters()}
    other = _nbytes(p for p in block.parameters() if id(p) not in skip)
    if not experts:
        return other
    args = model.args
    n, top = args.n_routed_experts, args.num_experts_per_tok
    distinct = n * (1 - (1 - top / n) ** tokens)
    e = experts[0]
    per_expert = _nbytes([e.w13[0], e.w2[0]])
    return other + distinct * per_expert


def step_bytes(model, batch: int, rows: int, context: int, layers: int | None) -> float:
    """A main-model decode step's bytes with `rows` rows a request."""
    per_layer = [_layer_bytes(model, block, batch * rows) for block in model.layers]
    if layers is not None:  # the deeper model: its dense layers as ours, the rest as our MoE layers
        dense = [b for b, blk in zip(per_layer, model.layers, strict=True) if not _is_moe(blk)]
        moe = [b for b, blk in zip(per_layer, model.layers, strict=True) if _is_moe(blk)]
        first = model.args.first_k_dense_replace
        moe_bytes = moe[0] if moe else _layer_bytes(model, model.mtp[0].block, batch * rows)
        per_layer = dense[:first] + [moe_bytes] * (layers - first)
    head = _nbytes(model.head.parameters()) + _nbytes(model.norm.parameters())
    row_bytes = (model.args.kv_lora_rank + model.args.qk_rope_head_dim) * 2
    kv = batch * context * len(per_layer) * row_bytes
    return sum(per_layer) + head + kv


def mtp_bytes(model, batch: int) -> float:
    """One draft pass: the MTP layer at one row a request, its projections and its head."""
    m = model.mtp[0]
    skip = {id(p) for p in m.block.parameters()} | {id(m.embed.weight)}
    return _layer_bytes(model, m.block, batch) + _nbytes(
        p for p in m.parameters() if id(p) not in skip
    )


def _is_moe(block) -> bool:
    return hasattr(block.ffn, "gate")


if __name__ == "__main__":
    main()
