"""A worker of several ranks: each rank's step handler (`make_rank_runner`, a `HandlerSpec` target that
`RankGroup` builds in every rank process and in the driver) holds that rank's model shard and `ModelRunner`, and
runs its share of each step round: `[plan_to_wire(plan) or None, KV control or None]`, answered
`[result_to_wire(result) or None, KV arrivals]`. A decode worker's ranks each hold a KV endpoint (`rank_kv`):
the round's control for the rank is applied before its share of the plan runs, and the transfers that arrived
are polled after it. `start_rank_group` starts such a group for a role's config.

Every rank sizes its cache as the driver does, then the ranks agree on the smallest count (a collective while
the handlers are built), so a page id the driver's scheduler hands out exists on every rank."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from pdserve import kernels
from pdserve.engine.rank_memory import worker_reserve_bytes
from pdserve.engine.ranks.group import RankGroup, RankGroupConfig, RankLauncher
from pdserve.engine.ranks.kv import RankKVEndpoint, rank_endpoint
from pdserve.engine.ranks.process import HandlerSpec, RankContext
from pdserve.engine.ranks.wire import plan_from_wire, result_to_wire
from pdserve.engine.runner import ModelRunner
from pdserve.model.loader import load_model
from pdserve.model.parallel import ParallelLayout, WorkerLayout

__all__ = ["RankRunner", "make_rank_runner", "start_rank_group"]

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class RankRunner:
    """One rank's step handler: `handler(round) -> reply` (see the module docstring), within the worker's kernel
    choice."""

    def __init__(
        self, runner: ModelRunner, kernel_choice: tuple[str | None, bool | None], rank: int,
        kv: RankKVEndpoint | None = None,
    ):  # fmt: skip
        self.runner, self.kernel_choice, self.rank, self.kv = runner, kernel_choice, rank, kv

    def __call__(self, wire: list) -> list:
        plan, control = wire
        if self.kv is not None:
            self.kv.apply(None if control is None else control[self.rank])
        result = None
        if plan is not None:
            with kernels.use(*self.kernel_choice):
                result = result_to_wire(self.runner.execute(plan_from_wire(plan)))
        return [result, [] if self.kv is None else self.kv.poll()]

    def close(self) -> None:
        if self.kv is not None:
            self.kv.close()
        self.runner.close()  # its graphs hold the group's collectives: gone before the group is


def make_rank_runner(
    ctx: RankContext, model_path: str, dtype: str | None, layout: dict[str, Any], page_size: int,
    num_pages: int | None, gpu_memory_fraction: float, cpu_cache_bytes: int, kv_cache_dtype: str,
    load_format: str = "safetensors", kernel_backend: str | None = None,
    batch_invariant: bool | None = None, kv: dict[str, Any] | None = None, cuda_graphs: bool = False,
    max_num_batched_tokens: int = 8192, max_running: int | None = None,
    layout_options: dict[str, Any] | None = None, num_drafts: int = 0,
) -> RankRunner:  # fmt: skip
    """Loads rank `ctx.rank`'s shard of the model under `WorkerLayout(**layout)` (with `ParallelLayout`'s
    `layout_options`, such as its exchange; None: its defaults) over the group the rank joined and builds its
    runner (collective: every rank of the group calls it at once). Decode steps replay CUDA graphs
    (`cuda_graphs`, on GPUs) unless an expert exchange needs the host (the all-to-all one). kv (a decode
    worker's ranks): `{"config": KVTransferConfig fields, "worker_id": the worker's id}`: the rank receives KV pages
    at `rank_endpoint(worker_id, rank)`."""
    choice = (kernel_backend, batch_invariant)
    parallel = ParallelLayout(
        WorkerLayout(**layout), rank=ctx.rank, group=ctx.group, **(layout_options or {})
    )
    with kernels.use(*choice):
        model = load_model(
            model_path, ctx.device, DTYPES.get(dtype or ""), progress=False, layout=parallel,
            load_format=load_format,
        )  # fmt: skip
        graphs = cuda_graphs and not any(e.host_sync for e in model.exchanges)
        if cuda_graphs and not graphs and ctx.rank == 0:
            log.warning(
                "decode steps run without CUDA graphs: the all-to-all exchange syncs the host"
            )
        reserve = worker_reserve_bytes(model, max_num_batched_tokens, max_running, num_drafts)
        sized = ModelRunner.sized(
            model, page_size, num_pages, gpu_memory_fraction, cpu_cache_bytes,
            cuda_graphs=graphs, kv_cache_dtype=kv_cache_dtype, rank=ctx.rank,
            reserve_bytes=reserve,
        )  # fmt: skip
    pages = torch.tensor([sized.num_pages], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=ctx.group)
    agreed = int(pages.item())
    runner = sized
    if agreed != sized.num_pages:
        del sized
        runner = ModelRunner(
            model, page_size, agreed, kv_cache_dtype, cuda_graphs=graphs, rank=ctx.rank
        )
    log.info(
        "rank %d of %d: model shard loaded, %d KV pages (%.2f GiB), %.2f GiB kept free for the largest step",
        ctx.rank, ctx.world_size, agreed, agreed * runner.cache.layout.page_bytes / 2**30, reserve / 2**30,
    )  # fmt: skip
    endpoint = None
    if kv is not None:
        from pdserve.kvtransfer import KVTransferConfig
        from pdserve.kvtransfer.dist import DistKVReceiver, connect_store

        config = KVTransferConfig(**kv["config"])
        name = rank_endpoint(kv["worker_id"], ctx.rank)
        store = connect_store(config, is_master=False, secret=kv.get("store_secret", ""))
        endpoint = RankKVEndpoint(DistKVReceiver(config, store, name, runner.cache.data))
    return RankRunner(runner, choice, ctx.rank, endpoint)


def start_rank_group(
    config: Any, model_path: str, dtype: str | None, kv_cache_dtype: str,
    launcher: RankLauncher | None = None, backend: str = "gloo", load_format: str = "safetensors",
    kernel_choice: tuple[str | None, bool | None] = (None, None), kv: dict[str, Any] | None = None,
    channel: str = "shm", store_host: str = "127.0.0.1",
) -> RankGroup:  # fmt: skip
    """Starts the `config.layout.ranks` ranks of a worker whose role config is `config` (`PrefillConfig` or
    `DecodeConfig`); rank 0 is this process. kv: each rank's KV endpoint (`make_rank_runner`); channel,
    store_host: as `RankGroupConfig`'s ('dist' and this node's address when ranks run on other nodes). Returns
    the running group (close it when the worker stops)."""
    handler = HandlerSpec(
        f"{__name__}:make_rank_runner",
        {
            "model_path": model_path, "dtype": dtype, "layout": dataclasses.asdict(config.layout),
            "page_size": config.page_size, "num_pages": config.num_pages,
            "gpu_memory_fraction": config.gpu_memory_fraction,
            "cpu_cache_bytes": config.cpu_cache_bytes, "kv_cache_dtype": kv_cache_dtype,
            "load_format": load_format, "kernel_backend": kernel_choice[0],
            "batch_invariant": kernel_choice[1], "kv": kv,
            "cuda_graphs": getattr(config, "cuda_graphs", False),
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_running": getattr(config, "max_running", None),
            "num_drafts": getattr(config, "num_speculative_tokens", 0),
        },
    )  # fmt: skip
    group_config = RankGroupConfig(
        config.layout.ranks, backend=backend, channel=channel, store_host=store_host
    )
    group = RankGroup(group_config, handler, launcher)
    try:
        group.start()
    except BaseException:
        group.close()
        raise
    return group
