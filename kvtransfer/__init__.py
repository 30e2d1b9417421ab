"""Moving a request's KV pages from a prefill worker to a decode worker.

`base` states the contract (`KVSender`, `KVReceiver`); `dist` implements it over torch.distributed (one process
group per (P, D) pair, NCCL for CUDA tensors, gloo for CPU ones); `loopback` implements it in one process for
tests. This package knows torch.distributed and the page layout, nothing else.

| module | its one job |
|---|---|
| `base` | the contract (`KVSender`, `KVReceiver`) |
| `config` | `KVTransferConfig` |
| `dist` | the contract over torch.distributed (`_link` a pair's group, `_receiver` D's side, `_wire` the format) |
| `loopback` | the contract in one process, for tests |
| `pages` | whole-page gathers and scatters of the page-major cache |
| `store` | the shared rendezvous store |
"""

from .base import (
    MAX_METADATA_BYTES,
    ExpectedTransfer,
    KVReceiver,
    KVSender,
    MakeReceiver,
    TransferResult,
)
from .config import KVTransferConfig

__all__ = [
    "MAX_METADATA_BYTES",
    "ExpectedTransfer",
    "KVReceiver",
    "KVSender",
    "KVTransferConfig",
    "MakeReceiver",
    "TransferResult",
]
