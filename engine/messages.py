"""Every message between the router and its workers; `engine.codec` carries them (msgpack bytes, never
pickle), and its names are importable from here too.

A message is a frozen dataclass. It travels as a map of its fields and is rebuilt from its type hints (nested
dataclasses, tuples); an error travels as its class name, message and field, and is raised again on the
caller's side. Request ids in these messages are the router's internal ids (unique per submission), never the
client's `request_id`, so a client reusing its id cannot touch another submission's state on a worker."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from pdserve.engine.codec import (  # noqa: F401 (re-exported: callers import the codec from here)
    WorkerError,
    decode,
    encode,
    reply,
    reply_error,
    unwrap,
)
from pdserve.engine.sampling_params import SamplingParams, TokenLogprobs
from pdserve.model import errors

# Router -> prefill worker.


RANK_GROUP_FAILED = "rank group failed"
"""In the error of every request a failed rank group ends: the router reports it as a lost worker (retryable)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillRequest:
    """What the router asks a prefill worker to do."""

    request_id: str
    token_ids: list[int]
    """The prompt, followed by any tokens generated before the request was preempted."""
    params: SamplingParams
    """With a concrete seed."""
    num_generated: int
    """Tokens generated before (the sampling step of the token sampled here)."""
    decode_peer: str
    """KV endpoint of the decode worker that reserved pages for this request (its worker id, or that of the rank
    holding the request: `Reservation.endpoint`)."""
    transfer_id: int
    """Its id for the transfer, issued by that decode worker."""
    dest_cuts: tuple[int, ...] = ()
    """That decode worker's advice on cutting the transfer (`Reservation.dest_cuts`)."""
    num_held_pages: int = 0
    """The request's first pages that decode worker holds already (`Reservation.num_held_pages`): they are
    not sent."""


# Prefill worker -> router.


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillFailure:
    """A request this worker could not hand over; the router fails it (the decode side frees its pages)."""

    request_id: str
    error: str


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillStats:
    worker_id: str
    num_queued: int
    queued_tokens: int
    num_sending: int
    pages_used: int
    pages_total: int
    kv_bytes_sent: int = 0
    """KV bytes the decode workers acknowledged, since start."""
    num_send_failures: int = 0
    """KV sends that failed (their requests moved or failed), since start."""
    step_s: float = 0.0
    """Seconds the worker's step in flight has run (0.0: between steps): with step_expected_s, the router's
    step deadline."""
    step_expected_s: float = 0.0
    """Seconds that step is expected to take, from the worker's measured speed (0.0: unknown)."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in its prefix cache, and of them those found there, since start (vLLM's
    prefix_cache_queries and prefix_cache_hits)."""
    prefix_cache_hits: int = 0
    host_kv_offloaded_pages: int = 0
    """The host-memory tier's pages stored, restored (host hits), and dropped for want of a slot, and the bytes
    copied either way, since start (`engine.worker.host_tier_counts`; 0 with the tier off)."""
    host_kv_restored_pages: int = 0
    host_kv_dropped_pages: int = 0
    host_kv_bytes_copied: int = 0
    kv_pages_sent: int = 0
    """KV pages the decode workers acknowledged, and pages not sent because the decode worker held them
    already (`PrefillRequest.num_held_pages`) with their bytes, since start."""
    kv_pages_not_sent: int = 0
    kv_bytes_not_sent: int = 0
    expert_rebalances: int = 0
    """Where its ranks hold spare expert slots (`WorkerLayout.redundant_experts`): placements of the copies
    computed and spare slots whose expert changed since start, and the balancedness of the routed rows in the
    window before the last placement (`ExpertBalancer.balancedness`; 0.0: none yet)."""
    expert_slots_moved: int = 0
    expert_balancedness: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class CacheEvents:
    """The pages' hashes (their first `prefix_cache.EVENT_HASH_BYTES` bytes) a worker's prefix cache took in and
    evicted since its last report, and its host tier stored and let go, for the router's placement
    (`pdserve.cluster.prefix_routing`). A hash cached on several ranks comes once per rank.

    The format grows by fields with defaults, never by changing one: a report without the host fields (a
    worker with no host tier, or of an earlier version) decodes as one that stores nothing on host. A page
    evicted to host memory comes as evicted and host_added, a page restored from it as host_evicted and added,
    a page the host pool lets go for a newer one as host_evicted alone."""

    added: list[bytes]
    evicted: list[bytes]
    reset: bool = False
    """The worker's log overflowed: `added` and `host_added` are (the newest part of) what it holds now, and the
    router forgets what it knew of it before."""
    host_added: list[bytes] = dataclasses.field(default_factory=list)
    """Hashes of pages stored in the host tier (`pdserve.engine.host_tier`), one per rank's pool."""
    host_evicted: list[bytes] = dataclasses.field(default_factory=list)
    """Hashes gone from the host tier: restored to the GPU, or their slot given to a newer page."""


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillPoll:
    """A prefill worker's answer to the router's long-poll."""

    failures: list[PrefillFailure]
    cache_events: CacheEvents | None = None


# Prefill worker -> decode worker, with the KV pages.


@dataclasses.dataclass(frozen=True, slots=True)
class StageTimes:
    """Seconds a request spent in each stage on one worker (0.0 for a stage that worker did not run)."""

    prefill_queue_s: float = 0.0
    """From its arrival on the worker to its first prefill chunk."""
    prefill_s: float = 0.0
    """From its first prefill chunk to its first token."""
    kv_transfer_s: float = 0.0
    """From the first token on the prefill worker to its KV in the decode worker's cache: the wait for the send
    there, then the transfer from its header's arrival on the decode worker (each part on its host's clock)."""
    decode_queue_s: float = 0.0
    """From the first token on the decode worker (sampled there, or arrived with its KV) to its first decode
    step."""

    def merged(self, other: StageTimes | None) -> StageTimes:
        """These stages, with those `other` ran (its non-zero ones) in."""
        if other is None:
            return self
        return StageTimes(
            *(
                b or a
                for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
            )
        )


@dataclasses.dataclass(frozen=True, slots=True)
class PackedLogprobs:
    """Log-probabilities of a run of tokens with as many alternatives each, as little-endian arrays: what a
    `PrefillHandoff` carries of a prompt's (8 bytes per entry, where a map per token costs some 50 more)."""

    k: int
    """Alternatives per token."""
    logprobs: bytes
    """float32 [n]."""
    ranks: bytes
    """int32 [n] (-1: none)."""
    top_ids: bytes
    """int32 [n, k]."""
    top_logprobs: bytes
    """float32 [n, k]."""

    @staticmethod
    def of(logprobs: list[TokenLogprobs]) -> PackedLogprobs:
        """Raises ValueError where the tokens have different numbers of alternatives."""
        k = len(logprobs[0].top_ids) if logprobs else 0
        if any(len(lp.top_ids) != k for lp in logprobs):
            raise ValueError("packed log-probabilities need as many alternatives for every token")
        f32, i32 = np.dtype("<f4"), np.dtype("<i4")
        return PackedLogprobs(
            k,
            np.array([lp.logprob for lp in logprobs], f32).tobytes(),
            np.array([-1 if lp.rank is None else lp.rank for lp in logprobs], i32).tobytes(),
            np.array([lp.top_ids for lp in logprobs], i32).tobytes(),
            np.array([lp.top_logprobs for lp in logprobs], f32).tobytes(),
        )

    def unpacked(self) -> list[TokenLogprobs]:
        """The tokens' `TokenLogprobs` (their values rounded to float32, as the model's log-softmax gives them).
        Raises TransferError where the arrays disagree."""
        f32, i32 = np.dtype("<f4"), np.dtype("<i4")
        values = np.frombuffer(self.logprobs, f32).tolist()
        ranks = np.frombuffer(self.ranks, i32).tolist()
        n, k = len(values), self.k
        top_ids = np.frombuffer(self.top_ids, i32)
        top_logprobs = np.frombuffer(self.top_logprobs, f32)
        if len(ranks) != n or top_ids.size != n * k or top_logprobs.size != n * k:
            raise errors.TransferError(
                f"packed log-probabilities of {n} tokens with unequal arrays"
            )
        ids, tops = top_ids.reshape(n, k).tolist(), top_logprobs.reshape(n, k).tolist()
        return [
            TokenLogprobs(v, tuple(i), tuple(t), None if r < 0 else r)
            for v, i, t, r in zip(values, ids, tops, ranks, strict=True)
        ]


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillHandoff:
    """What a prefill worker knows of a request beyond its KV and first token, sent with its pages (the
    transfer's metadata, `KVSender.send`) so that the decode worker's first output of the request is complete
    and its first decode step verifies drafts. A field added later must have a default, so that a handoff
    without it decodes."""

    logprobs: TokenLogprobs | None = None
    """The first token's log-probabilities, where the request asked for them."""
    stages: StageTimes = StageTimes()
    """The stages the prefill worker ran; its `kv_transfer_s` ends when its send began (the decode worker adds
    the transfer itself, on its own clock)."""
    draft_ids: tuple[int, ...] = ()
    """The MTP module's draft of the token after the first one, where the prefill worker speculates: the
    decode worker's first step verifies it (as drawn from a point mass: its distribution stays here)."""
    cached_tokens: int = 0
    """Its prompt tokens the prefill worker found in its prefix cache (its usage's cached_tokens)."""
    prompt_logprobs: PackedLogprobs | None = None
    """Its prompt log-probabilities, where it asked for them (`SamplingParams.prompt_logprobs`; their size is
    bounded by `MAX_PROMPT_LOGPROBS`)."""

    def to_bytes(self) -> bytes:
        return encode(self)

    @staticmethod
    def from_bytes(data: bytes) -> PrefillHandoff:
        """The handoff `to_bytes` made (empty bytes: an empty handoff). Raises TransferError when `data` is not
        one."""
        if not data:
            return PrefillHandoff()
        try:
            return decode(PrefillHandoff, data)
        except (ValueError, TypeError, AttributeError) as e:  # not msgpack, or not a handoff's map
            raise errors.TransferError(
                f"unreadable prefill handoff ({len(data)} bytes): {e}"
            ) from e


# Router -> decode worker.


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeRequest:
    """What the router asks a decode worker to hold."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    """With a concrete seed."""
    prefill_peer: str | None = None
    """Worker id of the prefill worker that will send the KV; None: prefill here (aggregated)."""
    generated_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Tokens generated before a preemption; their KV is recomputed with the prompt's."""


# Decode worker -> router.


@dataclasses.dataclass(frozen=True, slots=True)
class Reservation:
    """Where the prefill worker must send the request's KV: its transfer id here and the page count."""

    transfer_id: int
    num_pages: int
    dest_cuts: tuple[int, ...] = ()
    """The KV receiver's advice to the sender (`KVReceiver.expect`): where to cut the transfer's pages."""
    endpoint: str = ""
    """The KV endpoint the prefill worker sends to: the rank of a decode worker of several ranks that holds the
    request (`pdserve.engine.ranks.kv.rank_endpoint`); empty: the decode worker itself."""
    num_held_pages: int = 0
    """The request's first pages this decode worker holds already (its prefix cache, referenced for the
    request): the prefill worker sends only the pages after them (`num_pages - num_held_pages`; `dest_cuts`
    index those)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SpecCounts:
    """A request's speculation: draft tokens its decode steps verified, how many of them were accepted, and the
    decode steps that verified drafts (vLLM's "drafts")."""

    drafted: int
    accepted: int
    steps: int

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step gave on average: its target token and the drafts accepted before it
        (1 + accepted / steps; 1.0 with no step)."""
        return 1.0 + self.accepted / self.steps if self.steps else 1.0

    @staticmethod
    def total(counts: Iterable[SpecCounts | None]) -> SpecCounts | None:
        """The sum of `counts` (a request's parts on the workers it moved through, or a request's choices);
        None where none of them speculated."""
        present = [c for c in counts if c is not None]
        if not present:
            return None
        return SpecCounts(
            sum(c.drafted for c in present),
            sum(c.accepted for c in present),
            sum(c.steps for c in present),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """One request's share of one step, streamed back to the router."""

    request_id: str
    token_ids: list[int]
    """Tokens new since the last output."""
    finish_reason: str | None = None
    """stop, length or abort once finished."""
    error: str | None = None
    """Why the request was aborted by the worker (transfer failure, timeout, ...)."""
    preempted: bool = False
    """The worker gave the request's pages away: resubmit it with the tokens generated so far."""
    logprobs: list[TokenLogprobs | None] | None = None
    """Where the request asked for log-probabilities: one entry per token of `token_ids` (a first token a
    prefill worker sampled has those that came with its KV: `PrefillHandoff`)."""
    stages: StageTimes | None = None
    """The stages the request ran so far, on this worker and on the prefill worker whose KV it took
    (`PrefillHandoff`): on its first output after that KV arrived, and on its finishing output."""
    spec: SpecCounts | None = None
    """Where its decode steps on this worker verified drafts: how many, how many were accepted, and in how many
    steps; on its finishing output, and on an output that ends its stay here otherwise (preempted, or aborted
    by the worker), so that the router can add up the parts of a request that moved."""
    num_cached_tokens: int | None = None
    """On its first output with tokens from this worker, where a prefix cache served its prompt (here, or on
    the prefill worker whose KV it took): the prompt tokens found cached there (OpenAI's
    usage.prompt_tokens_details.cached_tokens)."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """On its first output with tokens, where it asked for them (`SamplingParams.prompt_logprobs`): per prompt
    token after the first, its log-probability given the tokens before it and the alternatives asked for."""


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeStats:
    worker_id: str
    num_running: int
    num_waiting: int
    pages_used: int
    pages_total: int
    max_running: int
    tokens_per_page: int
    num_preemptions: int
    """Since start."""
    spec: SpecCounts | None = None
    """Where the worker speculates: the drafts its decode steps verified and accepted since start (`steps`:
    the verifying steps of its requests, vLLM's `num_drafts`)."""
    spec_accepted_per_position: tuple[int, ...] = ()
    """Where the worker speculates: per draft position (the first draft after a step's token is position 0),
    drafts accepted there since start."""
    step_s: float = 0.0
    """Seconds the worker's step in flight has run (0.0: between steps): with step_expected_s, the router's
    step deadline."""
    step_expected_s: float = 0.0
    """Seconds that step is expected to take, from the worker's measured speed (0.0: unknown)."""
    prefix_cache_queries: int = 0
    """Tokens of aggregated requests looked up in its prefix cache, and of them those found there, since
    start (vLLM's prefix_cache_queries and prefix_cache_hits)."""
    prefix_cache_hits: int = 0
    host_kv_offloaded_pages: int = 0
    """The host-memory tier's pages stored, restored (host hits), and dropped for want of a slot, and the bytes
    copied either way, since start (`engine.worker.host_tier_counts`; 0 with the tier off)."""
    host_kv_restored_pages: int = 0
    host_kv_dropped_pages: int = 0
    host_kv_bytes_copied: int = 0
    kv_held_pages: int = 0
    """Pages of requests' KV found held here (this worker's prefix cache) when they were placed, which their
    prefill workers did not send, since start."""
    expert_rebalances: int = 0
    """Where its ranks hold spare expert slots (`WorkerLayout.redundant_experts`): placements of the copies
    computed and spare slots whose expert changed since start, and the balancedness of the routed rows in the
    window before the last placement (`ExpertBalancer.balancedness`; 0.0: none yet)."""
    expert_slots_moved: int = 0
    expert_balancedness: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class DecodePoll:
    """A decode worker's answer to the router's long-poll: its output batches, oldest first, and (where it
    prefills aggregated requests with the prefix cache on) its cache events."""

    outputs: list[RequestOutput]
    cache_events: CacheEvents | None = None
