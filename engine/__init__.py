"""The serving runtime every worker runs. So far: every router <-> worker message and their msgpack codec
(`messages`, pure Python: the router imports it without torch); the `Worker` base that the prefill and decode
workers share (`pdserve.engine.worker`, imported from there: it needs torch); the memory plan of a worker's layout
(`plan`: per rank weights by group, activation and workspace reserve, KV capacity, from the model's arguments
alone, without GPUs; `rank_memory`: the per-rank arithmetic it is made of); a worker's driver and its rank
processes (`rank_group`, `rank_process`), joined by one torch.distributed group, talking over a `plan_channel`
(shared memory, `shm_channel`, or gloo, `dist_channel`). The request checks the front end,
the schedulers and the offline path share are `pdserve.model.checks` (the offline path lives in `model`)."""

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
