"""Run by test_channel as its own process: a driver that starts a rank group of 3 (channel from argv), runs
one step, prints its ranks' process ids as one JSON line, then waits to be killed."""

from __future__ import annotations

import json
import sys
import time

from pdserve.engine.ranks.group import RankGroup, RankGroupConfig
from pdserve.engine.ranks.process import HandlerSpec

if __name__ == "__main__":
    config = RankGroupConfig(3, channel=sys.argv[1], join_timeout_s=120.0)
    group = RankGroup(config, HandlerSpec("_rank_handlers:echo"))
    group.start()
    replies = group.step({"step": 0})
    print(json.dumps([r["pid"] for r in replies[1:]]), flush=True)
    time.sleep(600)
