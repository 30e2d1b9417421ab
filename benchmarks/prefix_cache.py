"""The prefix cache's gain on one device: time to first token of a request whose long prefix is cached against the
same request computed whole, and time per output token with the cache on against off.

    python benchmarks/prefix_cache.py MODEL_DIR [--prefix 32768] [--suffix 64] [--max-tokens 64]
        [--trials 3] [--kv-cache-dtype fp8] [--load-format dummy] [--device cuda]

Two aggregated decode workers (the engine's scheduler, runner, CUDA graphs after their warm-up), one with the
prefix cache and one without, stepped in this process. Each trial draws a new prefix; on each worker (in turn,
the order alternating between trials) request A (the prefix and a suffix of its own) runs alone, then request B
(the prefix and another suffix), which on the cached worker finds the prefix's pages cached. Prints the medians
over the trials of B's time to first token (from its admission to its first output) and time per output token
(its first output to its last, per token after the first), their ratios, and the tokens B found cached. Greedy,
EOS ignored; random prompt tokens."""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    from pdserve.decode import DecodeConfig, DecodeWorker
    from pdserve.engine.messages import DecodeRequest
    from pdserve.engine.pages import pages_needed
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.model.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prefix", type=int, default=32768, help="shared prefix tokens")
    parser.add_argument("--suffix", type=int, default=64, help="each request's own tokens after it")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=8192, help="prefill tokens a step")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.prefix < args.page_size or args.suffix < 1 or args.max_tokens < 2:
        parser.error("--prefix must be >= --page-size, --suffix >= 1, --max-tokens >= 2")
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = load_model(args.model, args.device, dtype, progress=False, load_format=args.load_format)
    total = args.prefix + args.suffix + args.max_tokens
    if total > model.args.max_position_embeddings:
        parser.error(f"prefix + suffix + max tokens = {total}: past the model's context")
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist()

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def serve(worker: DecodeWorker, rid: str, prompt: list[int]) -> tuple[float, float, int]:
        """Time to first token, time per output token, cached tokens."""
        start = time.perf_counter()
        worker.add_request(DecodeRequest(rid, prompt, params))
        first = last = None
        cached = 0
        deadline = start + 600
        while True:
            assert time.perf_counter() < deadline, f"{rid} unfinished after 600 s"
            worker.step()
            for out in worker.poll_outputs():
                assert out.error is None, out.error
                now = time.perf_counter()
                if out.token_ids:
                    first, last = first or now, now
                cached = out.num_cached_tokens or cached
                if out.finish_reason is not None:
                    return first - start, (last - first) / (args.max_tokens - 1), cached

    workers = {}
    for caching in (True, False):
        config = DecodeConfig(
            page_size=args.page_size, num_pages=3 * pages_needed(total, args.page_size),
            max_num_batched_tokens=args.chunk, max_prefill_chunk=args.chunk,
            max_running=4, warm_up_context=total, enable_prefix_caching=caching,
        )  # fmt: skip
        workers[caching] = DecodeWorker(
            f"d{int(caching)}", model, config, kv_cache_dtype=args.kv_cache_dtype
        )
        workers[caching].warm_up()
    results: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
    for trial in range(args.trials):
        prefix = tokens(args.prefix)
        a, b = prefix + tokens(args.suffix), prefix + tokens(args.suffix)
        for caching in (True, False) if trial % 2 == 0 else (False, True):
            serve(workers[caching], f"A{trial}", a)
            results[caching].append(serve(workers[caching], f"B{trial}", b))
    for worker in workers.values():
        worker.close()

    def median(caching: bool, i: int) -> float:
        return statistics.median(r[i] for r in results[caching])

    hit_ttft, hit_tpot, cached = median(True, 0), median(True, 1), results[True][-1][2]
    cold_ttft, cold_tpot = median(False, 0), median(False, 1)
    print(f"prefix {args.prefix} + {args.suffix} tokens, {args.max_tokens} out, {args.trials} trials, "
          f"{model.args.num_hidden_layers} layers, kv {args.kv_cache_dtype}, {dev}")  # fmt: skip
    print(f"  cache on:  TTFT {hit_ttft * 1e3:9.1f} ms  TPOT {hit_tpot * 1e3:7.2f} ms  "
          f"({cached} tokens cached)")  # fmt: skip
    print(f"  cache off: TTFT {cold_ttft * 1e3:9.1f} ms  TPOT {cold_tpot * 1e3:7.2f} ms")
    print(f"  TTFT off / on {cold_ttft / hit_ttft:.2f}x; TPOT on / off {hit_tpot / cold_tpot:.3f}x")


if __name__ == "__main__":
    main()
