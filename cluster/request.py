"""`Request`: the router's record of one request in flight, shared by the router (its flow) and the admission
(its placement), so that neither imports the other."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from pdserve.cluster.pools import WorkerHandle
from pdserve.cluster.prefix_routing import PromptHashes
from pdserve.engine.messages import SpecCounts, StageTimes
from pdserve.engine.sampling_params import SamplingParams


@dataclasses.dataclass(eq=False)
class Request:
    """One request in flight. Its events queue receives D's outputs, P's failures and worker losses."""

    request_id: str
    """The router's id, unique per submission: workers and logs know the request by it."""
    client_id: str
    """The client's `request_id`, echoed in its responses; never used as a key."""
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float | None
    """loop.time() by which it must finish, or None."""
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    generated: list[int] = dataclasses.field(default_factory=list)
    decode: WorkerHandle | None = None
    prefill: WorkerHandle | None = None
    """Set while the prompt is on P (until the first token arrives from D)."""
    prefill_tokens: int = 0
    """Its prompt tokens counted in the queue of the worker computing them (`WorkerHandle.queued_tokens`)."""
    prefilling_on: WorkerHandle | None = None
    """The worker computing its prompt (P, or D where D prefills it), until the first token arrives."""
    expected_hits: dict[WorkerHandle, int] = dataclasses.field(default_factory=dict)
    """While it is being placed: the prompt tokens each candidate's prefix cache is expected to hold."""
    prompt_hashes: PromptHashes | None = None
    """While it is being placed: its prompt's page hashes (`prefix_routing`)."""
    decode_worker: str = ""
    prefill_worker: str = ""
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    num_preemptions: int = 0
    num_migrations: int = 0
    """Times the request moved to another worker after losing its own."""
    moved_at: float | None = None
    """time.monotonic() of its latest move, until its next token arrives."""
    finish_reason: str | None = None
    stages: StageTimes = dataclasses.field(default_factory=StageTimes)
    """The stages its last placement's workers ran, as D's outputs report them (the prefill worker's came to D
    with the KV)."""
    spec: SpecCounts | None = None
    """Its speculation so far: the sum of what its decode workers reported as its stays there ended (finished,
    preempted, aborted by the worker); None while none reported drafts verified. A stay on a lost worker
    reports nothing."""
    num_cached_tokens: int | None = None
    """Its prompt tokens its first prefill found in a prefix cache, as the first output that reported them
    said (a prefill again after a preemption or a move does not change it, as in vLLM)."""
    touched: set[WorkerHandle] = dataclasses.field(default_factory=set)
    pending: object = None
    """An event taken off `events` while merging outputs (`Router._coalesce`), handled next."""
    calls: set[asyncio.Future] = dataclasses.field(default_factory=set)
