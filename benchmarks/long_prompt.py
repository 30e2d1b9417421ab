"""A long prompt's prefill in chunks against one pass, on one GPU: time, peak memory, and the last token's logits.

    python benchmarks/long_prompt.py MODEL_DIR [--tokens 65536] [--chunk 8192] [--load-format dummy]
        [--batch-invariant] [--device cuda]

Prefills one request of `tokens` random prompt tokens through the model (`ForwardBatch`es, the paged cache),
once in one pass and once in chunks of `chunk` tokens, each chunk attending to the cached prefix before it in
blocks of `PREFIX_BLOCK_TOKENS` keys. Each way runs twice and the second is timed (CUDA events around the whole
prefill). Prints the time of each and their ratio, each way's peak memory above the weights and the cache against
the memory plan's reserve for a step of `chunk` tokens (`reserve_bytes_per_rank`), and how far the chunked
prefill's last-token logits are from the one pass's (bit for bit under --batch-invariant). `--tokens` past what
one pass fits: the one pass is skipped and the chunked run's memory checked alone."""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from pdserve import kernels
    from pdserve.engine.rank_memory import reserve_bytes_per_rank
    from pdserve.model.batch import PREFIX_BLOCK_TOKENS, SeqChunk, build_forward_batch
    from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
    from pdserve.model.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--no-one-pass", action="store_true", help="the chunked prefill alone")
    args = parser.parse_args()
    if args.tokens < 2 or args.chunk < 1:
        parser.error("--tokens must be >= 2 and --chunk >= 1")
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = load_model(args.model, args.device, dtype, progress=False, load_format=args.load_format)
    if args.tokens > model.args.max_position_embeddings:
        parser.error(
            f"--tokens {args.tokens}: past the model's {model.args.max_position_embeddings}"
        )
    ps = args.page_size
    num_pages = -(-args.tokens // ps) + 1
    layout = KVCacheLayout.for_model(model.args, ps, model.dtype, model.num_mtp)
    cache = PagedKVCache(layout, num_pages, dev)
    pages = list(range(1, num_pages))
    prompt = torch.randint(
        3, model.args.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def prefill(chunk: int) -> tuple[torch.Tensor, float, int]:
        sync()
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        start = time.perf_counter()
        logits = None
        for lo in range(0, args.tokens, chunk):
            hi = min(lo + chunk, args.tokens)
            batch = build_forward_batch([SeqChunk(prompt[lo:hi], lo, pages)], ps, dev, decode=False)
            hidden = model(batch, cache)
            if hi == args.tokens:
                logits = model.compute_logits(hidden[batch.logits_indices])[0].float()
            del hidden
        sync()
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated(dev) - base) if cuda else 0
        return logits, seconds, peak

    ways = [("chunked", args.chunk)] + ([] if args.no_one_pass else [("one pass", args.tokens)])
    results = {}
    with kernels.use_batch_invariant() if args.batch_invariant else _nothing():
        for name, chunk in ways:
            prefill(chunk)  # compiles, fills lazy caches
            results[name] = prefill(chunk)
    kind = "batch-invariant" if args.batch_invariant else "default"
    print(f"{args.tokens} tokens, chunks of {args.chunk}, prefix blocks of {PREFIX_BLOCK_TOKENS}, "
          f"{model.args.num_hidden_layers} layers, {kind} kernels")  # fmt: skip
    for name, chunk in ways:
        reserve = reserve_bytes_per_rank(model.args, model.dtype, model.layout.worker, chunk, 1)
        planned = reserve["activations"] + reserve["prefix attention block"]
        _, seconds, peak = results[name]
        print(f"  {name:9s} {seconds * 1e3:10.1f} ms   peak {peak / 2**30:7.2f} GiB   "
              f"plan's activations + prefix block {planned / 2**30:7.2f} GiB")  # fmt: skip
    if "one pass" in results:
        a, b = results["chunked"], results["one pass"]
        diff = (a[0] - b[0]).abs().max().item()
        print(f"  chunked / one pass: {a[1] / b[1]:.3f}x time; last-token logits max |diff| {diff:.3g}"
              f"{' (equal bits)' if torch.equal(a[0], b[0]) else ''}")  # fmt: skip


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
