"""`KVTransferConfig`: where the shared store is and how long transfers may take."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class KVTransferConfig:
    store_host: str = "127.0.0.1"
    """Host of the TCPStore through which (P, D) pairs rendezvous."""
    store_port: int = 29650
    """Port of that TCPStore."""
    backend: str = "auto"
    """`nccl`, `gloo`, or `auto`: NCCL when the cache is on a CUDA device, gloo otherwise."""
    timeout_s: float = 30.0
    """Longest one transfer may take once its header is on the wire, acknowledgement included."""
    connect_timeout_s: float = 60.0
    """Longest the two sides of a pair may wait for each other when building their process group."""
    idle_timeout_s: float = 900.0
    """Timeout of a pair's process group itself: a receive posted for an expected transfer may wait this long;
    past it the pair is rebuilt. Must exceed the decode workers' kv_wait_timeout_s."""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"backend={self.backend!r}: expected auto, nccl or gloo")
        if min(self.timeout_s, self.connect_timeout_s, self.idle_timeout_s) <= 0:
            raise ValueError("timeout_s, connect_timeout_s and idle_timeout_s must be positive")
        if not 0 < self.store_port < 65536:
            raise ValueError(f"store_port={self.store_port}: not a port number")
