"""Which data-parallel rank of a worker a new request goes to: the rank that holds the most of its prefix, balanced
against the ranks' load. Pure Python (no torch), called by the scheduler (`Scheduler._fit`).

Under data-parallel attention each rank has its own page allocator and prefix cache, so a request finds its
cached prefix only on the rank that computed (or received) it. Among the ranks with room for what the request
does not find cached there and with fewer requests than the per-rank cap, the choice is the smallest

    pages in use on the rank - pages of the request found cached there

then the fewest requests, then the lowest rank: a cached page counts as much as a page of load (it is a page
the request does not take there, and a page of prompt not computed or not sent). Without hits this is the
least-loaded rank, as before; a hot prefix that would pile every request on one rank spreads once that rank's
load exceeds the others' by more than the prefix's pages."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def pick_rank(
    used: Sequence[int], counts: Sequence[int], hits: Sequence[int], fits: Callable[[int], bool],
    cap: int | None,
) -> int | None:  # fmt: skip
    """The rank (index into `used`) by the module docstring's rule. used: pages in use per rank; counts:
    requests per rank; hits: pages of the request found cached per rank; fits(d): rank d has room for the
    request; cap: requests a rank holds at most (None: no limit). None when no rank qualifies."""
    if not len(used) == len(counts) == len(hits):
        raise ValueError(
            f"ranks disagree: {len(used)} used, {len(counts)} counts, {len(hits)} hits"
        )
    ok = [d for d in range(len(used)) if (cap is None or counts[d] < cap) and fits(d)]
    return min(ok, key=lambda d: (used[d] - hits[d], counts[d], d), default=None)
