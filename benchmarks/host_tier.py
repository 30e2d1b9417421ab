"""The host tier below the prefix cache on one device: the bandwidth of its batched copies between the KV cache
and host memory, and the time to first token of a request whose long prefix comes back from host memory
against the same request computed whole.

    python benchmarks/host_tier.py MODEL_DIR [--prefix 32768] [--suffix 64] [--trials 3]
        [--kv-cache-dtype fp8] [--load-format dummy] [--device cuda] [--copy-pages 512]

Bandwidth: a `HostKVStore` (pinned host memory on a GPU) over the model's KV cache; `--copy-pages` pages
restored host to device, and offloaded device to host, in one batch of consecutive slots and pages (one copy
run, as the pool hands out slots) and in one batch of scattered ones (a copy per page); the median of 5
timed batches after one untimed one, each timed to the end of its copies (`torch.cuda.synchronize`).

Time to first token: two aggregated decode workers (the engine's scheduler, runner, CUDA graphs after their
warm-up) stepped in this process: one with the prefix cache and a host tier, its GPU cache holding about one
request, and one with no cache at all. Each trial draws a new prefix; on the tiered worker request A (the prefix
and a suffix) runs, then a request of other tokens as long, whose pages evict A's to the host, then request B
(the prefix and another suffix), which finds the prefix's pages in host memory and has them copied back; on the
other worker B runs alone. Prints the medians over the trials of B's time to first token (admission to first
output) on both, their ratio, and the tokens B found cached and the pages restored."""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def copy_bandwidth(cache, num_pages: int, reps: int = 5) -> dict[str, float]:
    """GB/s of restores and offloads of `num_pages` pages between `cache` and a host pool of as many slots,
    batched as one run (consecutive) and as scattered pages."""
    from pdserve.engine.host_store import HostKVStore
    from pdserve.engine.host_tier import OFFLOAD, RESTORE, HostCopy

    store = HostKVStore(cache, num_pages)
    cuda = cache.device.type == "cuda"
    nbytes = num_pages * cache.layout.page_bytes
    g = torch.Generator().manual_seed(0)
    scattered_pages = torch.randperm(cache.num_pages, generator=g)[:num_pages].tolist()
    scattered_slots = torch.randperm(num_pages, generator=g).tolist()
    out = {}
    for how, pages, slots in (
        ("batched", list(range(num_pages)), list(range(num_pages))),
        ("scattered", scattered_pages, scattered_slots),
    ):
        for kind in (RESTORE, OFFLOAD):
            copies = [HostCopy(kind, p, s) for p, s in zip(pages, slots, strict=True)]
            times = []
            for rep in range(reps + 1):
                if cuda:
                    torch.cuda.synchronize(cache.device)
                start = time.perf_counter()
                store.run(copies)
                if cuda:
                    torch.cuda.synchronize(cache.device)
                if rep:  # the first is untimed
                    times.append(time.perf_counter() - start)
            direction = "host to device" if kind == RESTORE else "device to host"
            out[f"{direction}, {how}"] = nbytes / statistics.median(times) / 1e9
    return out


def main() -> None:
    from pdserve.decode import DecodeConfig, DecodeWorker
    from pdserve.engine.messages import DecodeRequest
    from pdserve.engine.pages import pages_needed
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache, resolve_cache_dtype
    from pdserve.model.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prefix", type=int, default=32768, help="shared prefix tokens")
    parser.add_argument("--suffix", type=int, default=64, help="each request's own tokens after it")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=8192, help="prefill tokens a step")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--copy-pages", type=int, default=512, help="pages per timed copy batch")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.prefix < args.page_size or args.suffix < 1 or args.copy_pages < 1:
        parser.error("--prefix must be >= --page-size, --suffix and --copy-pages >= 1")
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = load_model(args.model, args.device, dtype, progress=False, load_format=args.load_format)
    total = args.prefix + args.suffix + 2
    if total > model.args.max_position_embeddings:
        parser.error(f"prefix + suffix + 2 = {total}: past the model's context")

    layout = KVCacheLayout.for_model(
        model.args, args.page_size, resolve_cache_dtype(args.kv_cache_dtype, dtype), model.num_mtp
    )
    cache = PagedKVCache(layout, 2 * args.copy_pages, dev)
    bandwidth = copy_bandwidth(cache, args.copy_pages)
    del cache

    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist()

    params = SamplingParams(max_tokens=2, ignore_eos=True)

    def serve(worker: DecodeWorker, rid: str, prompt: list[int]) -> tuple[float, int]:
        """Time to first token, cached tokens."""
        start = time.perf_counter()
        worker.add_request(DecodeRequest(rid, prompt, params))
        first, cached = None, 0
        deadline = start + 600
        while True:
            assert time.perf_counter() < deadline, f"{rid} unfinished after 600 s"
            worker.step()
            for out in worker.poll_outputs():
                assert out.error is None, out.error
                if out.token_ids and first is None:
                    first = time.perf_counter() - start
                cached = out.num_cached_tokens or cached
                if out.finish_reason is not None:
                    return first, cached

    request_pages = pages_needed(total, args.page_size)
    workers = {}
    for tiered in (True, False):
        config = DecodeConfig(
            page_size=args.page_size, num_pages=request_pages + 2,
            max_num_batched_tokens=args.chunk, max_prefill_chunk=args.chunk,
            max_running=2, warm_up_context=total, enable_prefix_caching=tiered,
            host_kv_cache_bytes=2 * request_pages * layout.page_bytes if tiered else 0,
        )  # fmt: skip
        workers[tiered] = DecodeWorker(
            f"d{int(tiered)}", model, config, kv_cache_dtype=args.kv_cache_dtype
        )
        workers[tiered].warm_up()
    pool = workers[True].scheduler.host_pools[0]
    results: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    restored = []
    for trial in range(args.trials):
        prefix = tokens(args.prefix)
        a, b = prefix + tokens(args.suffix), prefix + tokens(args.suffix)
        for tiered in (True, False) if trial % 2 == 0 else (False, True):
            if tiered:
                serve(workers[True], f"A{trial}", a)
                serve(workers[True], f"evict{trial}", tokens(len(a)))
                before = pool.num_restored
            results[tiered].append(serve(workers[tiered], f"B{trial}", b))
            if tiered:
                restored.append(pool.num_restored - before)
    for worker in workers.values():
        worker.close()

    print(f"{model.args.num_hidden_layers} layers + {model.num_mtp} MTP, kv {args.kv_cache_dtype}, "
          f"page {args.page_size} tokens = {layout.page_bytes} bytes, {dev}")  # fmt: skip
    print(
        f"copies of {args.copy_pages} pages ({args.copy_pages * layout.page_bytes / 1e6:.1f} MB):"
    )
    for name, gbps in bandwidth.items():
        print(f"  {name:<28} {gbps:8.2f} GB/s")
    hit = statistics.median(r[0] for r in results[True])
    cold = statistics.median(r[0] for r in results[False])
    cached = results[True][-1][1]
    print(f"prefix {args.prefix} + {args.suffix} tokens, {args.trials} trials:")
    print(f"  host hit:  TTFT {hit * 1e3:9.1f} ms  ({cached} tokens cached, "
          f"{statistics.median(restored)} pages restored)")  # fmt: skip
    print(f"  recompute: TTFT {cold * 1e3:9.1f} ms")
    print(f"  TTFT recompute / host hit {cold / hit:.2f}x")


if __name__ == "__main__":
    main()
