"""KV transfer bandwidth between two GPUs, through pdserve's own path (DistKVSender -> DistKVReceiver over
NCCL, page-contiguous payload, acknowledgement after the pages are in the receiver's cache), next to a bare NCCL
send/recv of the same bytes on a two-rank group (the peer).

    python benchmarks/kv_transfer.py [--tokens 8192] [--layers 27] [--page-size 16] [--iters 20]

Needs 2 CUDA GPUs. Prints one table; writes it to $OUT/kv_transfer.md when OUT is set."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ENTRY_DIM = 576  # kv_lora_rank 512 + rope 64


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, args, port: int, results) -> None:
    from pdserve.kvtransfer import ExpectedTransfer, KVTransferConfig
    from pdserve.kvtransfer.dist import DistKVReceiver, DistKVSender, connect_store

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    num_pages = -(-args.tokens // args.page_size)
    shape = (args.layers, num_pages, args.page_size, ENTRY_DIM)
    config = KVTransferConfig(store_port=port, timeout_s=60, connect_timeout_s=60)
    store = connect_store(config, is_master=rank == 1)
    nbytes = torch.Size(shape).numel() * 2
    if rank == 1:  # decode side: a cache twice the payload, pages scattered
        cache = torch.zeros(args.layers, 2 * num_pages, args.page_size, ENTRY_DIM, dtype=torch.bfloat16,
                            device=device)  # fmt: skip

        def write(page_ids, pages):
            cache.index_copy_(1, torch.tensor(page_ids, device=device), pages)
            torch.cuda.current_stream().synchronize()

        receiver = DistKVReceiver(config, store, "d0", device, write, torch.bfloat16)
        dest = torch.randperm(2 * num_pages)[:num_pages].tolist()
        for i in range(args.iters + 3):
            receiver.expect(ExpectedTransfer(i + 1, "p0", dest, time.monotonic() + 60))
        done = 0
        while done < args.iters + 3:
            for r in receiver.poll():
                assert r.error is None, r.error
                done += 1
            time.sleep(0.001)
        torch.cuda.synchronize()
        # Check the last transfer landed: page p of the payload went to dest[p].
        expected_first = float(args.iters + 3)
        assert cache[:, dest[0]].float().mean().item() == expected_first
        receiver.close()
        bare_pg = dist.ProcessGroupNCCL(dist.PrefixStore("bare", store), 1, 2)
        buf = torch.empty(shape, dtype=torch.bfloat16, device=device)
        for _ in range(args.iters + 3):
            bare_pg.recv([buf], 0, 0).wait()
        torch.cuda.synchronize()
        time.sleep(2)
        return
    sender = DistKVSender(config, store, "p0", device)
    payload = torch.empty(shape, dtype=torch.bfloat16, device=device)
    source = torch.randn(
        args.layers, 2 * num_pages, args.page_size, ENTRY_DIM, device=device
    ).bfloat16()
    pages = torch.randperm(2 * num_pages, device=device)[:num_pages]
    times, gather_times = [], []
    for i in range(args.iters + 3):
        payload.fill_(float(i + 1))
        torch.cuda.synchronize()
        start = time.perf_counter()
        sender.send("d0", i + 1, payload, args.tokens, 0)
        elapsed = time.perf_counter() - start
        g0 = time.perf_counter()
        source.index_select(1, pages)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(elapsed)
            gather_times.append(time.perf_counter() - g0)
    bare_pg = dist.ProcessGroupNCCL(dist.PrefixStore("bare", store), 0, 2)
    bare = []
    for i in range(args.iters + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        bare_pg.send([payload], 1, 0).wait()
        torch.cuda.synchronize()
        if i >= 3:
            bare.append(time.perf_counter() - start)
    results["ours"] = statistics.median(times)
    results["gather"] = statistics.median(gather_times)
    results["bare"] = statistics.median(bare)
    results["bytes"] = nbytes
    sender.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 CUDA GPUs")
    port = _port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_run, args=(args, port, results), nprocs=2, join=True)
        r = dict(results)
    gb = r["bytes"] / 1e9
    rows = [
        ("pdserve send (header + pages + ack, into the cache)", r["ours"]),
        ("bare NCCL send/recv, same bytes", r["bare"]),
    ]
    lines = [
        f"{torch.cuda.get_device_name(0)} x2 | {args.tokens} tokens x {args.layers} layers x {ENTRY_DIM} "
        f"x bf16 = {r['bytes'] / 2**20:.1f} MiB | median of {args.iters}",
        "| path | ms | GB/s |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {1e3 * t:.3f} | {gb / t:.0f} |" for name, t in rows]
    lines.append(f"| (P-side page gather, not in the send) | {1e3 * r['gather']:.3f} | |")
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kv_transfer.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
