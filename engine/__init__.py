"""The serving runtime every worker runs, over the network of `pdserve.model`.

A step is `Scheduler.schedule()` -> `StepPlan` -> `ModelRunner.execute(plan)` per rank -> `RankResult` ->
`Scheduler.finish_step()`: the plan is the only thing the runner is told, and the scheduler never touches torch.
The names below are pure Python (no torch; the router and the schedulers import them without it); the modules
marked torch are imported from their modules.

| module | its one job |
|---|---|
| `scheduler` | the scheduler core: one set of queues; prefill-only, decode-only and aggregated are policies |
| `request` | a request's record and states in the scheduler |
| `step` | the per-step plan and its results (their wire format: `ranks/wire`) |
| `messages` | every router <-> worker message |
| `codec` | the messages' msgpack codec (and errors across it) |
| `sampling_params` | per-request sampling parameters and stop rules |
| `checks` | the request checks the front end, the scheduler and the offline path share |
| `pages` | the page allocator: reference-counted pages, the prefix cache's pages and their eviction |
| `prefix_cache` | which of a request's pages it shares through the prefix cache: the hash chain, hits, counts |
| `rank_choice` | the data-parallel rank a new request goes to: the most of its prefix, balanced against load |
| `grammar` | structured outputs' constraints: checked, compiled for llguidance, and how a request is constrained |
| `spec_policy` | when a speculating worker drafts: a batch-size limit and the measured acceptance |
| `chunking` | chunked-prefill planning |
| `host_tier` | the host-memory tier's bookkeeping: evicted pages' slots by hash, restores on a hit |
| `host_store` (torch) | the host tier's memory and its batched copies to and from the GPU cache |
| `step_timer` | how long the step in flight has run and is expected to take, for the router's stall check |
| `runner` (torch) | the model runner, with `sampler` and `cuda_graphs` |
| `grammar_masks` (torch) | the runner's grammar matchers per request and each pass's batched token mask |
| `speculative` (torch) | speculative decoding's arithmetic: drafting from MTP logits, verifying drafts |
| `drafter` (torch) | the MTP module's passes of a speculating step; the oracle draft for benchmarks |
| `draft_graphs` (torch) | CUDA graphs of a decode step's MTP passes |
| `worker` (torch) | the `Worker` base the prefill and decode roles share |
| `warm_up` (torch) | a worker's warm-up steps |
| `offline` (torch) | the single-process reference path of `pdserve offline` |
| `memory_plan` (torch) | a worker layout's memory plan from the model's arguments alone, without GPUs |
| `rank_memory` (torch) | the per-rank arithmetic the memory plan is made of |
| `step_profile` (torch) | a profile's device (or host) time, by part of the network and sampling, each kernel once |
| `ranks/` (torch) | a worker of several ranks: rank group, rank processes, plan channel, step handlers |
"""

from pdserve.engine.messages import (
    DecodeRequest,
    DecodeStats,
    PrefillFailure,
    PrefillRequest,
    PrefillStats,
    RequestOutput,
    Reservation,
    WorkerError,
)
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.scheduler import Scheduler, StepOutcome
from pdserve.engine.step import DecodeRow, PrefillRow, RankResult, RankStep, SampleSpec, StepPlan

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
