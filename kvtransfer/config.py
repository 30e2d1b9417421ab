"""`KVTransferConfig`: where the shared store is, how long transfers may take, how they are cut up."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class KVTransferConfig:
    store_host: str = "127.0.0.1"
    """Host of the TCPStore through which (P, D) pairs rendezvous."""
    store_port: int = 0
    """Port of that TCPStore; 0: a free one, picked when the server hosts the store (so that several servers
    share a host). Set one where a firewall allows only chosen ports."""
    backend: str = "auto"
    """`nccl`, `gloo`, or `auto`: NCCL when the cache is on a CUDA device, gloo otherwise."""
    timeout_s: float = 30.0
    """Longest one transfer may take once its header is on the wire, acknowledgement included."""
    connect_timeout_s: float = 60.0
    """Longest the two sides of a pair may wait for each other when building their process group."""
    chunk_bytes: int = 256 * 2**20
    """Largest piece a transfer is cut into along the page axis (whole pages, at least one), when P's pages are
    not one run of consecutive ids and the transfer is over `pipeline_min_bytes`: its pieces then ramp up from
    `first_piece_bytes` and back down (`_wire.chunk_plan`), so that P's packing of a piece and D's unpacking of
    one overlap the link. A run of pages travels as one piece, in place."""
    first_piece_bytes: int = 8 * 2**20
    """Size of the first and last pieces of a pipelined transfer (whole pages, at least one): the packing and
    unpacking left in the open."""
    pipeline_min_bytes: int = 32 * 2**20
    """Transfers up to this size travel as one piece: per piece, NCCL and the host cost more than the overlap
    saves."""
    max_receiver_runs: int = 8
    """A decode worker whose pages for a transfer over `pipeline_min_bytes` form 2 .. this many runs of
    consecutive ids asks the prefill worker (through the router) to cut the transfer at them: where P's pages
    are one run, every piece then lands in place, at one more NCCL message per run, against D
    unpacking a copy of the whole transfer. 1 never asks."""
    spin_s: float = 0.003
    """How long a wait for the link spins (polling, yielding between polls) before it sleeps between polls
    (tens of microseconds per wake-up). Spinning keeps those wake-ups off a transfer's latency, but a spinning
    thread competes for the GIL with the worker's loop thread; 0 never spins."""
    expect_grace_s: float = 5.0
    """How long a decode worker waits for its own expectation of a transfer whose header came first. A rank of a
    decode worker of several ranks learns what to expect with its worker's next step, which may come after the
    router has already asked the prefill worker to send; past this the transfer is discarded (acknowledged)."""
    idle_timeout_s: float = 900.0
    """Timeout of a pair's process group itself: a receive posted for an expected transfer may wait this long;
    the decode side retires a link whose next header has not come for half of it (an idle pair is rebuilt on
    next use). Must exceed the decode workers' kv_wait_timeout_s."""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"backend={self.backend!r}: expected auto, nccl or gloo")
        if min(self.timeout_s, self.connect_timeout_s, self.idle_timeout_s) <= 0:
            raise ValueError("timeout_s, connect_timeout_s and idle_timeout_s must be positive")
        if self.expect_grace_s < 0:
            raise ValueError(f"expect_grace_s={self.expect_grace_s}: must not be negative")
        if not 0 <= self.store_port < 65536:
            raise ValueError(f"store_port={self.store_port}: not a port number")
        if self.spin_s < 0:
            raise ValueError(f"spin_s={self.spin_s}: must not be negative")
        if self.chunk_bytes <= 0 or self.first_piece_bytes <= 0:
            raise ValueError(
                f"chunk_bytes={self.chunk_bytes}, first_piece_bytes={self.first_piece_bytes}: must be positive"
            )
        if self.max_receiver_runs < 1:
            raise ValueError(f"max_receiver_runs={self.max_receiver_runs}: must be at least 1")
        if self.pipeline_min_bytes < 0:
            raise ValueError(f"pipeline_min_bytes={self.pipeline_min_bytes}: must not be negative")
