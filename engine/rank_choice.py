"""Which data-parallel rank of a worker a new request goes to: the rank that holds the most of its prefix, balanced
against the ranks' load. Pure Python (no torch), called by the scheduler (`Scheduler._fit`).

Under data-parallel attention each rank has its own page allocator and prefix cache (and host pool, with the host
tier on), so a request finds its cached prefix only on the rank that computed (or received) it. Among the ranks
with room for what the request does not find cached there and with fewer requests than the per-rank cap, the
choice is the smallest

    pages in use on the rank - (pages of the request found cached there
                                + HOST_HIT_WEIGHT x pages after those found in its host pool)

then the fewest requests, then the lowest rank: a cached page counts as much as a page of load (it is a page
the request does not take there, and a page of prompt not computed or not sent), a page in the host pool half as
much (`HOST_HIT_WEIGHT`). Without hits this is the least-loaded rank, as before; a hot prefix that would pile
every request on one rank spreads once that rank's load exceeds the others' by more than the prefix's pages."""

from __future__ import annotations

from collections.abc import Callable, Sequence

HOST_HIT_WEIGHT = 0.5
"""What a page of the request's prefix found in a rank's host pool counts for, against a page found cached on its
GPU (1). Of a GPU hit's two gains a host hit has one: its prompt rows are not computed again, but it takes a
fresh GPU page there (the page is copied back into one), so it does not lighten the rank's memory; and the copy
is not free (it shares the host link with the tier's offloads, and the step after it waits for it). So half:
a host-held prefix attracts the request over an equally loaded rank that holds nothing, a GPU-held one of the
same length beats it, and a rank's load counts against a host hit twice as fast as against a GPU hit."""


def pick_rank(
    used: Sequence[int], counts: Sequence[int], hits: Sequence[int], fits: Callable[[int], bool],
    cap: int | None, host_hits: Sequence[int] | None = None,
) -> int | None:  # fmt: skip
    """The rank (index into `used`) by the module docstring's rule. used: pages in use per rank; counts:
    requests per rank; hits: pages of the request found cached per rank; fits(d): rank d has room for the
    request; cap: requests a rank holds at most (None: no limit); host_hits: pages after those found in the
    rank's host pool (None: none anywhere). None when no rank qualifies."""
    host_hits = host_hits if host_hits is not None else [0] * len(used)
    if not len(used) == len(counts) == len(hits) == len(host_hits):
        raise ValueError(
            f"ranks disagree: {len(used)} used, {len(counts)} counts, {len(hits)} hits, "
            f"{len(host_hits)} host hits"
        )
    ok = [d for d in range(len(used)) if (cap is None or counts[d] < cap) and fits(d)]
    return min(
        ok,
        key=lambda d: (used[d] - hits[d] - HOST_HIT_WEIGHT * host_hits[d], counts[d], d),
        default=None,
    )
