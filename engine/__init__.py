"""The serving runtime every worker runs, over the network of `pdserve.model`.

Pure Python (no torch; the router and the schedulers import these without it): every router <-> worker message
and their msgpack codec (`messages`); per-request sampling parameters and stop rules (`sampling_params`); the
request checks the front end, the schedulers and the offline path share (`checks`); the page allocator
(`pages`); chunked-prefill planning (`chunking`).

With torch, imported from their modules: the model runner (`runner`: forward passes and sampling, `sampler`,
`cuda_graphs`); the `Worker` base the prefill and decode workers share (`worker`); the single-process reference
path of `pdserve offline` (`offline`); the memory plan of a worker's layout (`memory_plan`: per rank weights by
group, activation and workspace reserve, KV capacity, from the model's arguments alone, without GPUs;
`rank_memory`: the per-rank arithmetic it is made of)."""

from .messages import (
    DecodeRequest,
    DecodeStats,
    PrefillFailure,
    PrefillRequest,
    PrefillStats,
    RequestOutput,
    Reservation,
    WorkerError,
)

__all__ = [
    "DecodeRequest",
    "DecodeStats",
    "PrefillFailure",
    "PrefillRequest",
    "PrefillStats",
    "RequestOutput",
    "Reservation",
    "WorkerError",
]
