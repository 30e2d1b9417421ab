"""The serving runtime every worker runs, over the network of `pdserve.model`.

A step is `Scheduler.schedule()` -> `StepPlan` -> `ModelRunner.execute(plan)` per rank -> `RankResult` ->
`Scheduler.finish_step()`: the plan is the only thing the runner is told, and the scheduler never touches torch.

Pure Python (no torch; the router and the schedulers import these without it): the scheduler core
(`scheduler`: one set of queues; prefill-only, decode-only and aggregated are policies of its `Request` records,
`request`); the per-step plan and its results (`step`, msgpack-able); every router <-> worker message and their
msgpack codec (`messages`); per-request sampling parameters and stop rules (`sampling_params`); the request
checks the front end, the scheduler and the offline path share (`checks`); the page allocator (`pages`);
chunked-prefill planning (`chunking`); the per-pool layout fields' checks (`layout`).

With torch, imported from their modules: the model runner (`runner`, with `sampler` and `cuda_graphs`); the
`Worker` base the prefill and decode roles share (`worker`); the single-process reference path of `pdserve
offline` (`offline`); the memory plan of a worker's layout (`memory_plan`: per rank weights by group, activation
and workspace reserve, KV capacity, from the model's arguments alone, without GPUs; `rank_memory`: the per-rank
arithmetic it is made of); a worker's driver and its rank processes (`rank_group`, `rank_process`), joined by one
torch.distributed group, talking over a `plan_channel` (shared memory, `shm_channel`, or gloo, `dist_channel`);
each rank's model shard and runner behind a step handler (`rank_runner`)."""

from .messages import (
    DecodeRequest,
    DecodeStats,
    PrefillFailure,
    PrefillRequest,
    PrefillStats,
    RequestOutput,
    Reservation,
    WorkerError,
)
from .request import Policy, Request, RequestState
from .scheduler import Scheduler, StepOutcome
from .step import DecodeRow, PrefillRow, RankResult, RankStep, SampleSpec, StepPlan

__all__ = [
    "DecodeRequest",
    "DecodeRow",
    "DecodeStats",
    "Policy",
    "PrefillFailure",
    "PrefillRequest",
    "PrefillRow",
    "PrefillStats",
    "RankResult",
    "RankStep",
    "Request",
    "RequestOutput",
    "RequestState",
    "Reservation",
    "SampleSpec",
    "Scheduler",
    "StepOutcome",
    "StepPlan",
    "WorkerError",
]
