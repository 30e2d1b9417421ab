"""Handlers for rank-group tests, importable by spawned rank processes as '_rank_handlers:<name>'."""

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
