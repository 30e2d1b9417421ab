"""When a speculating worker drafts: `SpecPolicy` picks each step's draft count, 0 where drafting costs more than
it gives; `SpecStats` counts what its steps verified. Pure Python (no torch).

A step verifies drafts only while every data-parallel rank runs at most `max_batch` requests (past it the
verify rows and draft passes cost more than the tokens they add, as measured) and while the acceptance measured
on the running traffic (an exponential average over recent verify steps) stays at or above `min_acceptance`.
When acceptance has switched drafting off, every `probe_every` steps two steps draft again (one proposes, the
next verifies), so that the measure follows the traffic. With drafting off the MTP module does not run over the
decode rows (it is a whole MoE layer): their positions in its cache layer stay stale, which costs acceptance
later, never a token."""

from __future__ import annotations

import dataclasses

from pdserve.engine.messages import SpecCounts

__all__ = ["SpecPolicy", "SpecStats"]


@dataclasses.dataclass(slots=True)
class SpecPolicy:
    num_drafts: int
    """Drafts a step proposes where it drafts."""
    max_batch: int | None = None
    """Requests a rank runs at most for a step to draft (None: no limit)."""
    min_acceptance: float = 0.0
    """Drafts accepted per draft verified, below which drafting stops (0: never)."""
    probe_every: int = 32
    smoothing: float = 0.1
    """Weight of a step's acceptance in the running average."""
    acceptance: float | None = None
    """The running average (None: nothing verified yet)."""
    _off_steps: int = 0

    def __post_init__(self) -> None:
        if self.max_batch is not None and self.max_batch < 0:
            raise ValueError(f"max_batch={self.max_batch}: must be >= 0")
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"min_acceptance={self.min_acceptance}: must be in [0, 1]")

    def drafts_for_step(self, busiest_rank: int) -> int:
        """This step's drafts, for a worker whose busiest rank runs `busiest_rank` requests."""
        if not self.num_drafts:
            return 0
        if self.max_batch is not None and busiest_rank > self.max_batch:
            return 0
        if self.acceptance is None or self.acceptance >= self.min_acceptance:
            self._off_steps = 0
            return self.num_drafts
        self._off_steps += 1
        return self.num_drafts if self._off_steps % self.probe_every in (0, 1) else 0

    def verified(self, drafted: int, accepted: int) -> None:
        """A step's verify groups together: `drafted` drafts verified, `accepted` of them accepted."""
        if drafted <= 0:
            return
        rate = accepted / drafted
        if self.acceptance is None:
            self.acceptance = rate
        else:
            self.acceptance += self.smoothing * (rate - self.acceptance)


@dataclasses.dataclass(slots=True)
class SpecStats:
    """Speculation's counts since start (Prometheus counters): decode steps of a request that verified drafts
    (vLLM's `num_drafts`), drafts verified, drafts accepted, and per draft position the drafts accepted
    there. `num_drafts` here is the drafts a step proposes (the positions)."""

    num_drafts: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_drafts

    def count(self, drafted: int, accepted: int) -> None:
        """One request's verify group: `drafted` drafts verified, its first `accepted` of them accepted."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def totals(self) -> SpecCounts | None:
        """The counts as a `SpecCounts` (`steps` the verifying steps); None where nothing speculates."""
        return SpecCounts(self.drafted, self.accepted, self.steps) if self.num_drafts else None
