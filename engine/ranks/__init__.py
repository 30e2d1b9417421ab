"""A worker of several ranks: its driver's rank group, the rank processes, the plan channel between them, each
rank's step handler and the KV endpoints of a decode worker's ranks.

| module | its one job |
|---|---|
| `group` | `RankGroup`: the driver's view of its N ranks, joined by one torch.distributed group |
| `process` | one rank 1..N-1 in its own process, answering the driver until told to stop |
| `channel` | the driver -> ranks plan channel (`PlanChannel`, its codec, `RankLostError`) |
| `wire` | the step plan and the ranks' results as msgpack-able buffers (`plan_to_wire`, `result_from_wire`, ...) |
| `shm_channel`, `dist_channel` | the channel over shared memory (one node) and over gloo (several nodes) |
| `runner` | each rank's model shard and runner behind a step handler; `start_rank_group` |
| `kv` | KV transfers into a decode worker's data-parallel ranks |
"""
