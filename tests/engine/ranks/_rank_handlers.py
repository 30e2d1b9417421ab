"""Handlers for rank-group tests, imported by spawned rank processes by this module's name."""

from __future__ import annotations

import hashlib
import os
import time


def echo(ctx, tag: str = ""):
    """Replies with the rank, the tag and a digest of the plan's blob; a plan may ask one rank to exit, to
    raise or to stall, to test how the driver sees it."""

    def handle(plan):
        if plan.get("exit_on") == ctx.rank:
            os._exit(3)
        if plan.get("raise_on") == ctx.rank:
            raise ValueError(f"asked to fail on rank {ctx.rank}")
        if plan.get("stall_on") == ctx.rank:
            time.sleep(plan["stall_s"])
        blob = plan.get("blob", b"")
        reply = {"rank": ctx.rank, "tag": tag, "step": plan["step"], "pid": os.getpid(),
                 "sha": hashlib.sha256(blob).hexdigest()}  # fmt: skip
        if plan.get("reply_bytes"):
            reply["blob"] = bytes([ctx.rank]) * plan["reply_bytes"]
        return reply

    return handle


PAGE_SIZE = 16


def model_step(ctx, ckpt: str, layout: dict, num_pages: int):
    """Rank `ctx.rank`'s share of the tiny model under `WorkerLayout(ctx.world_size, **layout)`, with its
    own paged cache. A plan is {"decode": bool, "chunks": [per rank: [{"request", "tokens", "start",
    "pages"}]]}; the reply is {request: [float32 logits bytes, greedy token]} for this rank's chunks (an empty
    share runs the idle step that keeps the expert exchange in step)."""
    import torch

    from pdserve.model.batch import SeqChunk, build_forward_batch
    from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
    from pdserve.model.loader import load_model
    from pdserve.model.parallel import ParallelLayout, WorkerLayout

    torch.set_num_threads(1)
    worker = WorkerLayout(ctx.world_size, **layout)
    parallel = ParallelLayout(worker, rank=ctx.rank, group=ctx.group)
    model = load_model(ckpt, dtype=torch.float32, use_mtp=False, progress=False, layout=parallel)
    cache_layout = KVCacheLayout.for_model(model.args, PAGE_SIZE, torch.float32, model.num_mtp)
    cache = PagedKVCache(cache_layout, num_pages, "cpu")

    @torch.inference_mode()
    def handle(plan):
        mine = plan["chunks"][ctx.rank]
        if not mine:
            model.forward_idle()
            return {}
        chunks = [SeqChunk(c["tokens"], c["start"], c["pages"]) for c in mine]
        batch = build_forward_batch(chunks, PAGE_SIZE, "cpu", decode=plan["decode"])
        logits = model.compute_logits(model(batch, cache)[batch.logits_indices])  # [R, vocab]
        return {
            c["request"]: [logits[row].float().numpy().tobytes(), int(logits[row].argmax())]
            for row, c in enumerate(mine)
        }

    return handle


def all_reduce(ctx):
    """Sums each rank's (rank + 1) x plan["scale"] over the worker's group on the rank's device; replies with
    the sum and the device it ran on."""
    import torch
    import torch.distributed as dist

    def handle(plan):
        t = torch.full((4,), float(ctx.rank + 1) * plan["scale"], device=ctx.device)
        dist.all_reduce(t, group=ctx.group)
        return {"sum": t.tolist(), "device": str(t.device)}

    return handle
