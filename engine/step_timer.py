"""`StepTimer`: how long a worker's current step has run and how long it is expected to take, so that the router
can tell a stalled worker from one running a long step (a long prefill chunk is not a hang).

A step's work is the tokens it computes (prompt chunk tokens plus each decode row's token and drafts), each
weighed up by the context it attends to. Steps are kept in buckets of work by powers of two, each holding the
slowest seconds per token of work measured there lately: a decayed maximum, so that one slow step (a machine
busy for a moment) raises it at once and it comes down over the following steps of that bucket. A step's
expectation is its work times its bucket's seconds per token; for a bucket not measured yet, the lesser of two
bounds: its work at the nearest smaller bucket's seconds per token (they fall as steps grow: the fixed cost of a
step spreads over more tokens), and the time of the largest step of the nearest larger bucket at that bucket's
seconds per token (a bigger step takes longer). So it errs long, never short. Before any step has been measured
the expectation is unknown (0.0)."""

from __future__ import annotations

import math
import time

from pdserve.engine.step import StepPlan

DECAY = 0.98
"""Per measured step of a bucket, how much of its slowest seconds per token so far is kept."""


CONTEXT_TOKENS = 2048
"""Keys of context whose attention a query token is counted to cost as much as its own pass through the layers.
Small (DeepSeek-V3's layers cost as much as attention over several times as many keys), so that a step over a
long context errs long: a chunk attending to a long cached prefix is not a hang."""


def step_work(plan: StepPlan) -> float:
    """The plan's work on its busiest rank (ranks run side by side), in tokens: each prompt chunk token and each
    decode row's token and drafts, each weighed up by the context it attends to (`CONTEXT_TOKENS`)."""
    return max(
        (
            sum(
                len(r.token_ids) * (1 + (r.start + len(r.token_ids) / 2) / CONTEXT_TOKENS)
                for r in step.prefill
            )
            + sum((1 + r.drafts) * (1 + r.position / CONTEXT_TOKENS) for r in step.decode)
            for step in plan.ranks
        ),
        default=0.0,
    )


def _bucket(work: float) -> int:
    """Bucket b holds work from 2**(b-1) to 2**b (less than 1: bucket 1)."""
    return max(1, math.ceil(work).bit_length())


class StepTimer:
    """Written by the worker's loop thread (`started`, `finished`), read by any thread (`current`). One
    attribute holds the step in flight, replaced whole, so a reader never sees half an update."""

    def __init__(self) -> None:
        self.seconds_per_token: dict[int, float] = {}
        """Per bucket (`_bucket`), the decayed maximum of measured seconds per token of work."""
        self._current: tuple[float, float] | None = None
        """The step in flight: (its start on time.monotonic(), its expected seconds)."""

    def expected_s(self, work: float) -> float:
        """Seconds a step of `work` (`step_work`) is expected to take (0.0: unknown)."""
        if work <= 0:
            return 0.0
        bucket = _bucket(work)
        bounds = []
        below = [b for b in self.seconds_per_token if b <= bucket]
        if below:
            bounds.append(work * self.seconds_per_token[max(below)])
        above = [b for b in self.seconds_per_token if b > bucket]
        if above:  # a step of that bucket's largest work takes at least as long as ours
            b = min(above)
            bounds.append(self.seconds_per_token[b] * (1 << b))
        return min(bounds, default=0.0)

    def started(self, plan: StepPlan) -> None:
        self._current = (time.monotonic(), self.expected_s(step_work(plan)))

    def finished(self, plan: StepPlan, measure: bool = True) -> None:
        """Ends the step `started` began and, unless `measure` is false (it failed), folds its speed into
        the expectation."""
        if self._current is None:
            return
        elapsed = time.monotonic() - self._current[0]
        self._current = None
        if measure:
            self.measured(elapsed, step_work(plan))

    def measured(self, elapsed_s: float, work: float) -> None:
        """Folds one step of `work` (`step_work`) that took `elapsed_s` into its bucket."""
        if work <= 0:
            return
        bucket = _bucket(work)
        kept = DECAY * self.seconds_per_token.get(bucket, 0.0)
        self.seconds_per_token[bucket] = max(elapsed_s / work, kept)

    def current(self) -> tuple[float, float]:
        """(seconds the step in flight has run, its expected seconds); (0.0, 0.0) between steps. The expected
        seconds are 0.0 while nothing has been measured."""
        current = self._current
        if current is None:
            return 0.0, 0.0
        return time.monotonic() - current[0], current[1]
