"""The `pdserve` command line. Each subcommand parses its flags here and calls into the package that does the work;
errors pdserve raises on purpose print as one line (`error: ...`) with exit code 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import grpc

from pdserve.cli.commands import (
    SAMPLING_DEFAULT,
    add_commands,
    add_temperature_flags,
    temperature_of,
)
from pdserve.cli.evaluate import add_eval_command, cmd_eval
from pdserve.cli.plan import add_plan_command, cmd_plan
from pdserve.model.errors import PdserveError


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    add_temperature_flags(g)
    g.add_argument(
        "--top-p", type=float, default=None,
        help="nucleus mass in (0, 1]; 1 disables; unset: the model's",
    )  # fmt: skip
    g.add_argument(
        "--top-k", type=int, default=None,
        help="keep the k most likely tokens; -1 disables; unset: the model's",
    )  # fmt: skip
    g.add_argument(
        "--min-p", type=float, default=None,
        help="drop tokens below min_p x the best; 0 disables; unset: the model's",
    )  # fmt: skip
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("--stop-token-ids", default="", help="comma-separated ids that end generation")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("runtime")
    g.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when present)"
    )
    g.add_argument(
        "--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
        help="activation dtype; auto: config.json's torch_dtype",
    )  # fmt: skip
    g.add_argument(
        "--load-format", default="safetensors", choices=["safetensors", "dummy"],
        help="safetensors: the checkpoint's weights; dummy: random weights of config.json's shapes made "
        "on the device (as `make-checkpoint --seed 0` writes them; no weight read from disk)",
    )  # fmt: skip
    g.add_argument(
        "--kernels", default="auto", choices=["auto", "ref", "triton"],
        help="auto: Triton on CUDA, torch references on CPU; ref/triton force one",
    )  # fmt: skip
    g.add_argument(
        "--page-size",
        type=int,
        default=64,
        help="tokens per KV cache page (64: the attention kernels' fast path reads whole 64-token tiles)",
    )
    g.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
        help="KV cache rows: auto (the activation dtype) or fp8 (e4m3 latent with a per-token "
        "scale; as `serve --model.kv-cache-dtype fp8` runs it)",
    )  # fmt: skip
    g.add_argument(
        "--batch-invariant", action="store_true",
        help="batch-invariant kernels, as `serve --model.batch-invariant true` runs them",
    )  # fmt: skip


def _add_distill_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "MTP distillation",
        "Train the checkpoint's MTP module on the main model's own greedy continuations of random prompts, "
        "so that speculative-decoding acceptance is measured on a draft that has learned its target. Trained: "
        "the MTP module's norms, eh_proj, attention, router weight and dense/shared-expert MLP; frozen: its "
        "routed experts, router bias, and embedding and head (copies of the main model's). The trained "
        "tensors are written back into the shards (same names and dtypes, fp8 re-quantized); every other "
        "tensor keeps its bytes. Prints the held-out top-1 agreement with the main model's greedy token "
        "(the acceptance a one-token greedy draft would reach).",
    )
    g.add_argument(
        "--distill-mtp", type=int, default=None, metavar="STEPS",
        help="after writing the random weights, distil the MTP module for STEPS optimizer steps",
    )  # fmt: skip
    g.add_argument(
        "--distill-only", action="store_true",
        help="OUT is an existing checkpoint: distil its MTP module in place, write nothing else "
        "(--preset, --layers, --dtype, --override and the writing flags are ignored)",
    )  # fmt: skip
    g.add_argument("--distill-lr", type=float, default=1e-3, help="peak AdamW learning rate")
    g.add_argument(
        "--distill-seq-len", type=int, default=128,
        help="tokens per sequence: 8 random prompt tokens, then the greedy continuation",
    )  # fmt: skip
    g.add_argument("--distill-batch-size", type=int, default=8, help="sequences per step")
    g.add_argument(
        "--distill-sequences", type=int, default=256,
        help="training sequences generated (32 more are held out)",
    )  # fmt: skip
    g.add_argument(
        "--distill-device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when present)"
    )


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise PdserveError(f"{flag}: expected comma-separated integers, got {text!r}") from e


def _build_parser(config_flags: bool = True) -> tuple[argparse.ArgumentParser, dict]:
    """The parser and the handlers of the serving subcommands (`serve`'s per-field flags import torch:
    `config_flags` leaves them out for the other commands)."""
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated prefill/decode serving for DeepSeek-V3/R1-class models.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mk = sub.add_parser(
        "make-checkpoint",
        help="write a random-weight checkpoint in the official DeepSeek-V3 layout",
        description="Writes random weights in the official DeepSeek-V3 layout (safetensors shards with an "
        "index, per-expert names, fp8 weight_scale_inv, the MTP layer), config.json, "
        "generation_config.json and a locally built tokenizer.",
    )
    mk.add_argument("out", help="output directory (created; must be empty)")
    mk.add_argument("--preset", default="tiny", choices=["tiny", "v2-lite-shape", "v3-shape"])
    mk.add_argument(
        "--layers", type=int, default=None, help="number of main layers (default: preset's)"
    )
    mk.add_argument("--dtype", default="bf16", choices=["bf16", "fp8", "fp32"])
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--shard-size-mb", type=int, default=2048, help="largest shard, MiB")
    mk.add_argument(
        "--gen-device", default="cpu", help="where random numbers are drawn (cpu or cuda)"
    )
    mk.add_argument(
        "--config-only", action="store_true",
        help="config.json, generation_config.json and the tokenizer, no weights: serve or run it with "
        "`--model.load-format dummy` / `--load-format dummy` (the same weights for the same --seed)",
    )  # fmt: skip
    mk.add_argument(
        "--override", action="append", default=[], metavar="KEY=JSON",
        help="set a config.json field, e.g. --override q_lora_rank=null (repeatable)",
    )  # fmt: skip
    _add_distill_flags(mk)

    off = sub.add_parser(
        "offline",
        help="generate in one process without Ray (the reference path)",
        description="Loads the model in this process and generates for one prompt: prefill, then one "
        "decode step per token over the paged KV cache. " + SAMPLING_DEFAULT,
    )
    off.add_argument("--model", required=True, help="checkpoint directory, or 'tiny'")
    src = off.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    off.add_argument("--max-new-tokens", type=int, default=32)
    off.add_argument(
        "--prefill-chunk", type=int, default=None, help="prefill in chunks of N tokens"
    )
    off.add_argument(
        "--speculative-tokens", type=int, default=0, metavar="K",
        help="draft K tokens a step with the checkpoint's MTP module and verify them (0: off, at most "
        "4); greedy outputs are unchanged",
    )  # fmt: skip
    off.add_argument(
        "--json", action="store_true", help='print {"token_ids": [...], "text": "..."}'
    )
    _add_sampling_flags(off)
    _add_runtime_flags(off)
    add_plan_command(sub)
    add_eval_command(sub)
    return parser, add_commands(sub, config_flags)


def _resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _resolve_dtype(name: str):
    """None for auto: the loader takes config.json's torch_dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(name)


def _sampling_params(args: argparse.Namespace, max_tokens: int, model_dir: Path):
    """As the server builds them: flags left unset take generation_config.json's values (SAMPLING_DEFAULT)."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.frontend.validation import GenerationDefaults

    model = GenerationDefaults.from_file(model_dir / "generation_config.json")
    temperature = temperature_of(args)

    def given(value, default):
        return default if value is None else value

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=given(temperature, model.temperature),
        top_p=given(args.top_p, model.top_p),
        top_k=given(args.top_k, model.top_k),
        min_p=given(args.min_p, model.min_p),
        seed=args.seed,
        stop_token_ids=tuple(_int_list(args.stop_token_ids, "--stop-token-ids")),
        ignore_eos=args.ignore_eos,
    )


_DISTILL_FLAGS = {
    "steps": "--distill-mtp", "lr": "--distill-lr", "seq_len": "--distill-seq-len",
    "batch_size": "--distill-batch-size", "train_sequences": "--distill-sequences",
    "device": "--distill-device",
}  # fmt: skip


def _distill_config(args: argparse.Namespace):
    """The distillation asked for, checked before any weight is written; None when not asked."""
    from pdserve.model.mtp_distill import DistillConfig

    if args.distill_mtp is None:
        if args.distill_only:
            raise PdserveError("--distill-only: give the steps with --distill-mtp STEPS")
        return None
    if args.config_only:
        raise PdserveError("--distill-mtp: --config-only writes no weights to distil")
    if args.distill_only and not (Path(args.out) / "config.json").is_file():
        raise PdserveError(f"--distill-only: {args.out} is not a checkpoint (no config.json)")
    try:
        return DistillConfig(
            steps=args.distill_mtp, lr=args.distill_lr, seq_len=args.distill_seq_len,
            batch_size=args.distill_batch_size, train_sequences=args.distill_sequences,
            device=_resolve_device(args.distill_device), seed=args.seed,
        )  # fmt: skip
    except ValueError as e:  # DistillConfig's message starts with the field's name
        field = str(e).split("=", 1)[0]
        raise PdserveError(f"{_DISTILL_FLAGS.get(field, 'MTP distillation')}: {e}") from e


def _distill(args: argparse.Namespace, config) -> None:
    from pdserve.model.mtp_distill import distill_mtp

    start = time.perf_counter()
    result = distill_mtp(args.out, config, log=lambda line: print(line, flush=True))
    print(
        f"distilled MTP of {args.out} in {time.perf_counter() - start:.1f}s: held-out agreement "
        f"{result.initial_agreement:.4f} -> {result.final_agreement:.4f}"
    )


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from pdserve.model.random_checkpoint import make_checkpoint

    distill = _distill_config(args)
    if args.distill_only:
        _distill(args, distill)
        return 0
    overrides = {}
    for item in args.override:
        key, sep, value = item.partition("=")
        if not sep:
            raise PdserveError(f"--override {item!r}: expected KEY=JSON")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise PdserveError(f"--override {item!r}: value is not JSON ({e})") from e
    start = time.perf_counter()
    out = make_checkpoint(
        args.out, args.preset, args.layers, args.dtype, args.seed, overrides,
        shard_bytes=args.shard_size_mb << 20, device=args.gen_device, weights=not args.config_only,
    )  # fmt: skip
    what = "config and tokenizer, no weights," if args.config_only else ""
    print(
        f"wrote {args.preset} ({args.dtype}) {what} to {out} in {time.perf_counter() - start:.1f}s"
    )
    if distill is not None:
        _distill(args, distill)
    return 0


def cmd_offline(args: argparse.Namespace) -> int:
    from pdserve.engine.offline import OfflineGenerator
    from pdserve.kernels import use_backend, use_batch_invariant
    from pdserve.model.loader import load_model
    from pdserve.model.random_checkpoint import resolve_model
    from pdserve.model.tokenizer import Tokenizer

    model_dir = resolve_model(args.model)
    params = _sampling_params(args, args.max_new_tokens, model_dir)
    has_tokenizer = (model_dir / "tokenizer.json").is_file()
    tokenizer = Tokenizer(model_dir) if has_tokenizer or args.prompt is not None else None
    if args.prompt is not None:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = _int_list(args.prompt_ids, "--prompt-ids")
    with use_backend(args.kernels), use_batch_invariant(args.batch_invariant):
        model = load_model(
            model_dir, _resolve_device(args.device), _resolve_dtype(args.dtype),
            load_format=args.load_format,
        )  # fmt: skip
        if not 0 <= args.speculative_tokens <= 4:
            raise PdserveError(f"--speculative-tokens {args.speculative_tokens}: must be in [0, 4]")
        generator = OfflineGenerator(
            model, args.page_size, args.prefill_chunk, args.kv_cache_dtype, args.speculative_tokens
        )
        start = time.perf_counter()
        result = generator.generate(prompt_ids, params)
        elapsed = time.perf_counter() - start
    text = tokenizer.decode(result.token_ids) if tokenizer is not None else ""
    spec = ""
    if result.num_drafted:
        spec = (
            f", {result.num_accepted}/{result.num_drafted} drafts accepted, "
            f"{len(result.token_ids) / max(result.num_steps - 1, 1):.2f} tokens a decode step"
        )
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": text}))
    else:
        print(text)
        print(
            f"[{len(prompt_ids)} prompt tokens, {len(result.token_ids)} generated in {elapsed:.2f}s, "
            f"finish_reason={result.finish_reason}{spec}]",
            file=sys.stderr,
        )
    return 0


COMMANDS = {
    "make-checkpoint": cmd_make_checkpoint, "offline": cmd_offline, "plan": cmd_plan, "eval": cmd_eval,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, serving = _build_parser(config_flags="serve" in argv)
    args = parser.parse_args(argv)
    commands = {**COMMANDS, **serving}
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return commands[args.command](args)
    except PdserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            print("(is `pdserve serve` running there? see --addr)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
