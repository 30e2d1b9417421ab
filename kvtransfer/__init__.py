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
| `store` | the shared rendezvous store, every value signed (`SignedStore`) |

The rendezvous. A pair's group meets through the deployment's TCPStore, which any client that reaches it can read
and write. Every value the workers put there is signed (HMAC-SHA256, keyed by a per-deployment secret handed to
the workers through Ray, never written to the store) over its key name, which holds the pair and its epoch: a
value forged or copied from another key reads as absent, an epoch moves only by a signed value newer than the one
a side has seen, and a side puts back its own values that go missing while its peer may need them (`store`,
`_link`). A signing store, rather than the workers' Ray calls, because torch's gloo and NCCL groups rendezvous
through a `dist.Store` from C++: signing it keeps them unchanged and this package free of Ray.
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
