from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_SERVING: WorkerState
WORKER_STATE_DRAINING: WorkerState

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "state", "num_gpus", "node_ip", "num_requests", "num_queued", "queued_tokens", "num_running", "num_waiting", "kv_pages_used", "kv_pages_total", "page_size", "num_preemptions")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    state: WorkerState
    num_gpus: int
    node_ip: str
    num_requests: int
    num_queued: int
    queued_tokens: int
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    page_size: int
    num_preemptions: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., state: _Optional[_Union[WorkerState, str]] = ..., num_gpus: _Optional[int] = ..., node_ip: _Optional[str] = ..., num_requests: _Optional[int] = ..., num_queued: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., page_size: _Optional[int] = ..., num_preemptions: _Optional[int] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("role", "workers")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class LostWorker(_message.Message):
    __slots__ = ("worker_id", "role", "reason", "lost_s_ago", "replaced_by", "not_replaced", "replacement_error", "num_requests_migrated")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOST_S_AGO_FIELD_NUMBER: _ClassVar[int]
    REPLACED_BY_FIELD_NUMBER: _ClassVar[int]
    NOT_REPLACED_FIELD_NUMBER: _ClassVar[int]
    REPLACEMENT_ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    reason: str
    lost_s_ago: float
    replaced_by: str
    not_replaced: str
    replacement_error: str
    num_requests_migrated: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., reason: _Optional[str] = ..., lost_s_ago: _Optional[float] = ..., replaced_by: _Optional[str] = ..., not_replaced: _Optional[str] = ..., replacement_error: _Optional[str] = ..., num_requests_migrated: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("model", "pools", "num_requests", "output_tokens_per_s", "uptime_s", "aggregated", "kv_cache_dtype", "lost_workers", "num_workers_lost", "num_workers_replaced", "num_requests_migrated", "restarts_stopped", "endpoints")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    AGGREGATED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOST_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_LOST_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_REPLACED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_STOPPED_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    num_requests: int
    output_tokens_per_s: float
    uptime_s: float
    aggregated: bool
    kv_cache_dtype: str
    lost_workers: _containers.RepeatedCompositeFieldContainer[LostWorker]
    num_workers_lost: int
    num_workers_replaced: int
    num_requests_migrated: int
    restarts_stopped: str
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    def __init__(self, model: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., num_requests: _Optional[int] = ..., output_tokens_per_s: _Optional[float] = ..., uptime_s: _Optional[float] = ..., aggregated: _Optional[bool] = ..., kv_cache_dtype: _Optional[str] = ..., lost_workers: _Optional[_Iterable[_Union[LostWorker, _Mapping]]] = ..., num_workers_lost: _Optional[int] = ..., num_workers_replaced: _Optional[int] = ..., num_requests_migrated: _Optional[int] = ..., restarts_stopped: _Optional[str] = ..., endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("name", "address", "auth", "tls")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    auth: str
    tls: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., auth: _Optional[str] = ..., tls: _Optional[str] = ...) -> None: ...

class ScalePoolRequest(_message.Message):
    __slots__ = ("role", "count")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    role: Role
    count: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., count: _Optional[int] = ...) -> None: ...

class ScalePoolResponse(_message.Message):
    __slots__ = ("added", "removed", "pool")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    pool: PoolStatus
    def __init__(self, added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., pool: _Optional[_Union[PoolStatus, _Mapping]] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "num_requests_drained")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_DRAINED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_requests_drained: int
    def __init__(self, worker_id: _Optional[str] = ..., num_requests_drained: _Optional[int] = ...) -> None: ...
