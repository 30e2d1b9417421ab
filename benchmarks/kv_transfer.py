"""KV transfer bandwidth between two ranks, through pdserve's own path (DistKVSender -> DistKVReceiver, page-major
caches), next to a bare send/recv of the same bytes on a two-rank group (the peer).

    python benchmarks/kv_transfer.py [--tokens 8192] [--layers 27] [--page-size 16] [--iters 20]
        [--pages runs,scattered] [--chunk-mib 256,48,0] [--gap-ms 0,10] [--spin-ms 3]
        [--pipeline-min-mib 32] [--trace DIR]
    python benchmarks/kv_transfer.py --device cpu --tokens 256 --layers 4 --chunk-mib 0.25,0 --pipeline-min-mib 0

`--pages runs`: the request's pages are one run of consecutive ids in both caches (what the allocators hand out
while they can): the pages travel in place, one message, no copy. `--pages scattered`: random pages on both
sides: P packs them piece by piece, D unpacks them. `run-to-runs`: one run on P, four on D (a fuller decode
pool): P cuts the transfer where D advised (`KVReceiver.expect`, as the router passes it on), every piece lands
in place. `run-to-scattered`: one run on P, random pages on D: D unpacks. On CUDA it needs 2 GPUs (NCCL); on
CPU it runs two processes
over gloo (a functional check, not a bandwidth figure; gloo packs every piece). Two times per transfer, both from
the call to `send`: until D has the last page in its cache and reported the transfer (D's
`TransferResult.completed_at`; both ranks read the same monotonic clock), which is when D can decode; and until
P has read D's acknowledgement, which also pays the trip back. `--chunk-mib` is the largest piece of scattered
pages (`KVTransferConfig.chunk_bytes`; 0 sends each transfer as one piece). `--gap-ms` idles between transfers,
so that the receiver's wait for the header has left its spin phase (how transfers arrive when serving); 0 runs
them back to back. The transferred pages are checked at the end. PDSERVE_DUMP_AFTER_S=N prints every thread's
stack and ends a rank still running after N seconds. Prints one table; writes it to $OUT/kv_transfer.md when
OUT is set."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.kvtransfer import KVTransferConfig
from pdserve.kvtransfer.store import new_secret

ENTRY_DIM = 576  # kv_lora_rank 512 + rope 64
WARMUP = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cases(args) -> list[tuple[str, float, float]]:
    """(pages, largest piece in MiB, gap in ms); a run travels as one piece whatever the largest."""
    cases = []
    for mode in args.pages:
        for mib in args.chunk_mib if mode == "scattered" else args.chunk_mib[:1]:
            cases += [(mode, mib, gap) for gap in args.gap_ms]
    return cases


MODES = ("runs", "scattered", "run-to-runs", "run-to-scattered")


def _pages(mode: str, rank: int, num_pages: int) -> list[int]:
    """A request's pages in a cache of 7 * num_pages pages; each mode has pages of its own on each side, so that
    every mode's pages can be checked at the end (checking in between would sync D's device while a header
    receive is posted). Runs are n pages from 2n, 3n or 4n; random pages are drawn from the first 2n (scattered)
    or from the last 2n (D's in run-to-scattered); D's four runs in run-to-runs lie in 3n .. 5n, the last
    quarter first."""
    n = num_pages
    if mode == "runs" or (rank == 0 and mode.startswith("run-to-")):
        start = {"runs": 2 * n, "run-to-runs": 3 * n, "run-to-scattered": 4 * n}[mode]
        return list(range(start, start + n))
    if mode == "run-to-runs":
        bounds = [i * n // 4 for i in range(5)]
        gap = n // 4 + 1
        starts = [3 * n + gap * i for i in (3, 0, 1, 2)]
        pages = []
        for start, a, b in zip(starts, bounds, bounds[1:], strict=False):
            pages += range(start, start + b - a)
        return pages
    g = torch.Generator().manual_seed(rank)
    base = 5 * n if mode == "run-to-scattered" else 0
    return [base + p for p in torch.randperm(2 * n, generator=g)[:n].tolist()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _page_sums(cache: torch.Tensor, pages: list[int]) -> list[float]:
    """One checksum per transferred page, in transfer order: [n]."""
    ids = torch.tensor(pages, device=cache.device)
    return cache.index_select(0, ids).float().sum(dim=(1, 2, 3)).tolist()


def _bare_group(store, rank: int, device: torch.device):
    prefixed = dist.PrefixStore("bare", store.raw)  # torch's own group, unsigned: the reference
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(prefixed, rank, 2)
    return dist.ProcessGroupGloo(prefixed, rank, 2)


def _run(rank: int, args, port: int, results) -> None:
    if not args.trace:
        _measure(rank, args, port, results)
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _measure(rank, args, port, results)
    prof.export_chrome_trace(os.path.join(args.trace, f"kv_transfer_rank{rank}.json"))


def _measure(rank: int, args, port: int, results) -> None:
    from pdserve.kvtransfer import ExpectedTransfer
    from pdserve.kvtransfer.dist import DistKVReceiver, DistKVSender, connect_store
    from pdserve.kvtransfer.pages import gather_pages, scatter_pages

    if os.environ.get("PDSERVE_DUMP_AFTER_S"):  # a hang: every thread's stack, then the rank ends
        faulthandler.dump_traceback_later(float(os.environ["PDSERVE_DUMP_AFTER_S"]), exit=True)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    num_pages = -(-args.tokens // args.page_size)
    cache_shape = (7 * num_pages, args.layers, args.page_size, ENTRY_DIM)
    payload_shape = (num_pages, args.layers, args.page_size, ENTRY_DIM)
    config = KVTransferConfig(
        store_port=port, timeout_s=60, connect_timeout_s=60, spin_s=args.spin_ms / 1e3,
        pipeline_min_bytes=int(args.pipeline_min_mib * 2**20),
    )  # fmt: skip
    store = connect_store(config, is_master=rank == 1, secret=args.secret)
    num_transfers = len(_cases(args)) * (WARMUP + args.iters)
    pages = _pages("scattered", rank, num_pages)
    if rank == 1:  # decode side
        cache = torch.zeros(cache_shape, dtype=torch.bfloat16, device=device)
        receiver = DistKVReceiver(config, store, "d0", cache)
        transfer_id = 0
        for mode, _, _ in _cases(args):
            for _ in range(WARMUP + args.iters):
                transfer_id += 1
                cuts = receiver.expect(
                    ExpectedTransfer(
                        transfer_id, "p0", _pages(mode, 1, num_pages), time.monotonic() + 600
                    )
                )  # fmt: skip
                store.set(f"cuts/{transfer_id}", ",".join(map(str, cuts)))
        completed, deadline = {}, time.monotonic() + 600
        while len(completed) < num_transfers:
            for r in receiver.poll():
                assert r.error is None, r.error
                completed[r.transfer_id] = r.completed_at
            done = len(completed)
            assert time.monotonic() < deadline, f"{done} of {num_transfers} transfers arrived"
            time.sleep(0.001)
        results["d_sums"] = {m: _page_sums(cache, _pages(m, 1, num_pages)) for m in args.pages}
        results["completed_at"] = completed
        results["timeline"] = {t: (seen, posted) for t, seen, posted in receiver.timeline}
        receiver.close()
        staging = torch.empty(payload_shape, dtype=torch.bfloat16, device=device)
        ids = torch.tensor(pages, device=device)
        for name, fn in [
            ("scatter", lambda: scatter_pages(cache, ids, staging)),
            ("scatter_torch", lambda: cache.index_copy_(0, ids, staging)),
        ]:
            results[name] = statistics.median(_timed(fn, device) for _ in range(args.iters))
        bare_pg = _bare_group(store, 1, device)
        for _ in range(len(args.gap_ms) * (WARMUP + args.iters)):
            bare_pg.recv([staging], 0, 0).wait()
            _sync(device)
        time.sleep(2)
        return
    sender = DistKVSender(config, store, "p0", device)
    source = torch.randn(cache_shape, device=device).bfloat16()
    transfer_id = 0
    for mode, mib, gap_ms in _cases(args):
        src_pages = _pages(mode, 0, num_pages)
        if mib > 0:
            sender.config = dataclasses.replace(config, chunk_bytes=int(mib * 2**20))
        else:
            sender.config = dataclasses.replace(config, pipeline_min_bytes=2**62)
        times, posted, started, header = [], [], {}, {}
        for i in range(WARMUP + args.iters):
            source[src_pages[transfer_id % num_pages]].add_(1.0)  # later transfers carry other data
            transfer_id += 1
            # D's advice, as the router would pass it on (read before the clock starts)
            cuts = tuple(int(c) for c in store.get(f"cuts/{transfer_id}").decode().split(",") if c)
            time.sleep(gap_ms / 1e3)
            elapsed = _timed(
                lambda tid=transfer_id, pages=src_pages, cuts=cuts: sender.send(
                    "d0", tid, source, pages, args.tokens, 0, cuts
                ),
                device,
            )
            if i >= WARMUP:
                times.append(elapsed)
                posted.append(sender.last_profile["d0"].posted_s)
                started[transfer_id] = sender.last_profile["d0"].started_at
                header[transfer_id] = sender.last_profile["d0"].header_s
        results[("ours", mode, mib, gap_ms)] = (
            statistics.median(times),
            statistics.median(posted),
            sender.last_profile["d0"].num_pieces,
            started,
            header,
        )
    results["p_sums"] = {m: _page_sums(source, _pages(m, 0, num_pages)) for m in args.pages}
    ids = torch.tensor(pages, device=device)
    for name, fn in [
        ("gather", lambda: gather_pages(source, ids)),
        ("gather_torch", lambda: source.index_select(0, ids)),
    ]:
        results[name] = statistics.median(_timed(fn, device) for _ in range(args.iters))
    payload = source.index_select(0, ids)
    bare_pg = _bare_group(store, 0, device)
    bare = {}
    for (
        gap_ms
    ) in args.gap_ms:  # the same idle time before each send as ours, D's receive already posted
        times = []
        for i in range(WARMUP + args.iters):
            time.sleep(gap_ms / 1e3)
            elapsed = _timed(lambda: bare_pg.send([payload], 1, 0).wait(), device)
            if i >= WARMUP:
                times.append(elapsed)
        bare[gap_ms] = statistics.median(times)
    results["bare"] = bare
    results["bytes"] = payload.numel() * payload.element_size()
    sender.close()


def _rate(gb: float, seconds: float) -> str:
    return f"{gb / seconds:.0f}" if gb / seconds >= 10 else f"{gb / seconds:.2f}"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--pages", type=lambda text: text.split(","), default=["runs", "scattered"],
        help="where the request's pages lie in both caches, comma-separated: runs, scattered",
    )  # fmt: skip
    parser.add_argument(
        "--chunk-mib", type=_floats, default=[256.0, 48.0, 0.0],
        help="largest piece sizes to measure, comma-separated (KVTransferConfig.chunk_bytes; 0: one piece)",
    )  # fmt: skip
    parser.add_argument(
        "--gap-ms", type=_floats, default=[0.0, 10.0],
        help="idle time before each transfer, comma-separated",
    )  # fmt: skip
    parser.add_argument(
        "--spin-ms", type=float, default=1e3 * KVTransferConfig().spin_s,
        help="KVTransferConfig.spin_s, in ms (both sides)",
    )  # fmt: skip
    parser.add_argument(
        "--pipeline-min-mib", type=float, default=KVTransferConfig().pipeline_min_bytes / 2**20,
        help="KVTransferConfig.pipeline_min_bytes, in MiB: smaller transfers travel as one piece",
    )  # fmt: skip
    parser.add_argument(
        "--trace", metavar="DIR",
        help="write each rank's torch.profiler trace (chrome format) there; use with few transfers",
    )  # fmt: skip
    args = parser.parse_args()
    args.secret = new_secret()  # the two ranks' shared key for the store's values
    if not set(args.pages) <= set(MODES):
        parser.error(f"--pages {','.join(args.pages)}: expected some of {', '.join(MODES)}")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 CUDA GPUs (or --device cpu)")
    port = _port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_run, args=(args, port, results), nprocs=2, join=True)
        r = dict(results)
    for mode in args.pages:
        p_sums, d_sums = r["p_sums"][mode], r["d_sums"][mode]
        if p_sums != d_sums:
            bad = sum(a != b for a, b in zip(p_sums, d_sums, strict=True))
            raise SystemExit(
                f"{mode}: transferred pages differ from the source: {bad} of {len(p_sums)}"
            )
    gb, bare = r["bytes"] / 1e9, r["bare"]
    where = torch.cuda.get_device_name(0) + " x2, NCCL" if args.device == "cuda" else "CPU, gloo"
    lines = [
        f"{where} | {args.tokens} tokens x {args.layers} layers x {ENTRY_DIM} x bf16 = "
        f"{r['bytes'] / 2**20:.1f} MiB, page {args.page_size}, page-major caches | "
        f"median of {args.iters} | spin {args.spin_ms:g} ms | pages checked: equal",
        "",
        "| path | pieces | idle before | ms | GB/s | / bare | all posted at (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for gap, sec in bare.items():
        lines.append(
            f"| bare send/recv of the contiguous payload (receive posted) | 1 | {gap:g} ms | {1e3 * sec:.3f} "
            f"| {_rate(gb, sec)} | 1.00 | |"
        )
    steps = [
        "",
        "Where the time goes (medians, ms from P's call to `send`; both ranks read one monotonic clock):",
        "",
        "| pages | idle before | P posted the header | D saw the header | D posted the receives | "
        "pages in D's cache |",
        "|---|---|---|---|---|---|",
    ]
    for mode, mib, gap in _cases(args):
        t, posted, pieces, started, header = r[("ours", mode, mib, gap)]
        seen = [r["timeline"][i][0] - t0 for i, t0 in started.items() if i in r["timeline"]]
        recv = [r["timeline"][i][1] - t0 for i, t0 in started.items() if i in r["timeline"]]
        done = [r["completed_at"][i] - t0 for i, t0 in started.items()]
        cells = [
            statistics.median(x) if x else float("nan") for x in (header.values(), seen, recv, done)
        ]
        steps.append(
            f"| {mode} ({mib:g} MiB) | {gap:g} ms | "
            + " | ".join(f"{1e3 * c:.3f}" for c in cells)
            + " |"
        )
        landed = statistics.median(r["completed_at"][i] - t0 for i, t0 in started.items())
        if mode == "runs":
            how = "a run of pages to a run of pages"
        elif mode == "run-to-runs":
            how = "a run of pages to four runs, cut where D advised"
        elif mode == "run-to-scattered":
            how = "a run of pages to scattered pages"
        else:
            how = f"scattered pages to scattered pages ({f'{mib:g} MiB' if mib > 0 else 'whole'})"
        for what, sec, at in [("pages in D's cache", landed, ""), ("ack read by P", t, posted)]:
            at = f"{1e3 * at:.3f}" if at != "" else ""
            lines.append(
                f"| pdserve send -> {what}, {how} | {pieces} "
                f"| {gap:g} ms | {1e3 * sec:.3f} | {_rate(gb, sec)} | {bare[gap] / sec:.2f} | {at} |"
            )
    for side, op in [("P", "gather"), ("D", "scatter")]:
        for name, key in [("pdserve", op), ("torch index", f"{op}_torch")]:
            lines.append(
                f"| ({side}: {op} of all pages alone, {name}, for reference) | | | "
                f"{1e3 * r[key]:.3f} | | | |"
            )
    text = "\n".join(lines + steps)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kv_transfer.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
