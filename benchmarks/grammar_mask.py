"""What the structured-output mask costs a decode step: the same runner, the same batch, steps with every row
unconstrained and then with every row constrained to a JSON schema (or a regex), median step time of each and
their ratio (the target: at most 1.10 at batch 64 on an H200, v2-lite shape).

    python benchmarks/grammar_mask.py MODEL_DIR [--batch 64] [--context 512] [--steps 40] [--device cuda]
        [--load-format dummy] [--constraint json_schema|regex] [--tokenizer tokenizer.json | --train-vocab]

The mask is matched against a tokenizer of the model's vocabulary size: the checkpoint's tokenizer.json, another
one (`--tokenizer`), or with `--train-vocab` a byte-level BPE of exactly the model's vocab_size trained here on
the Python standard library's source (a random checkpoint's own tokenizer is far smaller than its vocab_size,
and mask time grows with the vocabulary). Each row is a request whose grammar restarts once it ends, so every
step masks every row. CPU-runnable on the tiny model (`--device cpu`: a dry run; the figure is the GPU's).
Also reports the host's mask fill per step (llguidance's thread pool), which the GPU's forward hides."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import device_name, fill_cache  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
        },
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "score", "active"],
    "additionalProperties": False,
}
REGEX = r"(\+1 )?\(?[0-9]{3}\)?[ -][0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?; [A-Za-z ]{1,40}\."


def train_vocab(vocab_size: int, out: Path) -> Path:
    """A byte-level BPE of exactly `vocab_size` tokens (ids 0, 1, 2: BOS, EOS, PAD) trained on the Python
    standard library's source, written to out/tokenizer.json (reused when there)."""
    import sysconfig

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from pdserve.model.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN

    file = out / f"tokenizer-{vocab_size}.json"
    if file.is_file():
        return file
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))

    def lines():
        for path in sources:
            try:
                yield from path.read_text(encoding="utf-8").splitlines(keepends=True)
            except (UnicodeDecodeError, OSError):
                continue

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(lines(), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(file))
    print(f"trained a {tok.get_vocab_size()}-token BPE for {vocab_size} ids: {file}")
    return file


def run(runner, model, args, constrained, tables, tokens, stats) -> float:
    """Median step time of `args.steps` steps (after 5 of warm-up) over the batch."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.step import DecodeRow, RankStep, SampleSpec, StepPlan

    params = SamplingParams(max_tokens=10**6, temperature=1.0, seed=0, structured=constrained)
    eos = set(model.args.eos_token_ids)
    generation = [0] * args.batch  # a row's request restarts (a new id) when its grammar ends
    started = [False] * args.batch
    times = []
    tag = "c" if constrained else "u"
    for step in range(args.steps + 5):
        rows = []
        for b, t in enumerate(tokens):
            spec = SampleSpec.of(params, 0 if not started[b] else 1, counted=started[b])
            started[b] = True
            rows.append(
                DecodeRow(f"{tag}{b}.{generation[b]}", t, args.context + step, tables[b], spec)
            )
        plan = StepPlan(step, [RankStep(decode=rows)])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = runner.execute(plan)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if result.decode_error is not None:
            raise RuntimeError(f"decode step failed: {result.decode_error}")
        if step >= 5:
            times.append(time.perf_counter() - start)
        tokens = result.decode_tokens
        for b, t in enumerate(tokens):
            if f"{tag}{b}.{generation[b]}" in result.row_errors or t in eos:
                generation[b] += 1
                started[b] = False
                stats["restarts"] += 1
        stats["errors"] += len(result.row_errors)
    return statistics.median(times)


def main() -> None:
    from pdserve.engine.grammar import check
    from pdserve.engine.grammar_masks import GrammarMatchers
    from pdserve.engine.runner import ModelRunner
    from pdserve.engine.sampling_params import StructuredOutput
    from pdserve.model.loader import load_model
    from pdserve.model.random_checkpoint import resolve_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument(
        "--device", default="cuda", help="cuda (the measurement) or cpu (a dry run)"
    )
    parser.add_argument("--load-format", default="safetensors", help="safetensors or dummy")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--constraint", default="json_schema", choices=("json_schema", "regex"))
    parser.add_argument(
        "--tokenizer", help="a tokenizer.json to match against (default: the model's)"
    )
    parser.add_argument(
        "--train-vocab", action="store_true", help="train a BPE of the model's vocab_size to match"
    )
    parser.add_argument("--vocab-cache", default=str(Path(tempfile.gettempdir()) / "pdserve-vocab"))
    args = parser.parse_args()
    path = resolve_model(args.model)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = load_model(path, args.device, dtype, progress=False, load_format=args.load_format)
    vocab = model.args.vocab_size
    if args.train_vocab:
        tokenizer = train_vocab(vocab, Path(args.vocab_cache))
    else:
        tokenizer = Path(args.tokenizer) if args.tokenizer else path / "tokenizer.json"
    text = json.dumps(SCHEMA) if args.constraint == "json_schema" else REGEX
    constrained = check(StructuredOutput(args.constraint, text), "--constraint")
    pages_per_seq = -(-(args.context + args.steps + 8) // args.page_size)
    runner = ModelRunner(
        model, args.page_size, args.batch * pages_per_seq, cuda_graphs=not args.eager
    )
    runner.grammar = GrammarMatchers(tokenizer, vocab, model.args.eos_token_ids)
    fill_s: list[float] = []
    masks = runner.grammar.masks

    def timed_masks(*a, **k):
        start = time.perf_counter()
        out = masks(*a, **k)
        if out[0] is not None:
            fill_s.append(time.perf_counter() - start)
        return out

    runner.grammar.masks = timed_masks
    fill_cache(runner.cache)
    tables = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(args.batch)]
    tokens = torch.randint(3, vocab, (args.batch,)).tolist()
    stats = {"restarts": 0, "errors": 0}
    plain_s = run(runner, model, args, None, tables, tokens, stats)
    masked_s = run(runner, model, args, constrained, tables, tokens, stats)
    fill = sorted(fill_s[5:]) or sorted(fill_s)
    print(
        f"{device_name(args.device)} | {path.name} (vocab {vocab}, tokenizer {tokenizer.name}) | "
        f"batch {args.batch} x context {args.context} | {'eager' if args.eager else 'CUDA graphs'} | "
        f"{args.constraint}\n"
        f"| TPOT unconstrained | TPOT constrained | ratio | host mask fill (median, p90) | grammar "
        f"restarts | row errors |\n|---|---|---|---|---|---|\n"
        f"| {1e3 * plain_s:.2f} ms | {1e3 * masked_s:.2f} ms | {masked_s / plain_s:.3f} | "
        f"{1e3 * statistics.median(fill):.2f} ms, {1e3 * fill[int(0.9 * (len(fill) - 1))]:.2f} ms | "
        f"{stats['restarts']} | {stats['errors']} |"
    )


if __name__ == "__main__":
    main()
