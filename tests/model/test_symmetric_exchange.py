"""The one-sided expert exchange over torch symmetric memory: on two GPUs it gives the all-gather exchange's rows
and sums bit for bit, eager and replayed from a CUDA graph, ranks with no tokens included; on a CPU it refuses
with an error naming CUDA."""

from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from pdserve.model.errors import ConfigError
from pdserve.model.expert_exchange import make_exchange
from pdserve.model.parallel import ParallelLayout, WorkerLayout
from pdserve.model.symmetric_exchange import SymmetricMemoryExchange

NUM_EXPERTS, TOP_K, DIM, CAPACITY = 16, 4, 256, 32


def test_symmetric_exchange_needs_cuda():
    layout = ParallelLayout(WorkerLayout(2, "data", expert_parallel=2), exchange="symmetric")
    exchange = make_exchange(layout, NUM_EXPERTS)
    assert isinstance(exchange, SymmetricMemoryExchange)
    exchange.step_tokens = 2
    x = torch.randn(2, DIM)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(ConfigError, match="exchange='symmetric': needs CUDA GPUs"):
        exchange.dispatch(x, ids, torch.rand(2, TOP_K))


def _echo(exchange, x, ids, weights):
    """Dispatch, each row times its local weights (a row-wise stand-in for the experts), combine."""
    batch, handle = exchange.dispatch(x, ids, weights)
    local = torch.where(batch.topk_ids < exchange.experts_per_rank, batch.topk_weights, 0.0)
    y = (batch.x.float() * local.sum(1, keepdim=True)).to(x.dtype)
    return batch, exchange.combine(y, handle)


def _rank(rank: int, world: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from pdserve.model.expert_exchange import AllGatherExchange

    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world, device_id=device,
            timeout=timedelta(seconds=120),
        )  # fmt: skip
        layout = ParallelLayout(WorkerLayout(world, "data", expert_parallel=world), rank=rank)
        gather = AllGatherExchange(layout, NUM_EXPERTS, CAPACITY)
        symmetric = SymmetricMemoryExchange(layout, NUM_EXPERTS, CAPACITY)
        checks = {}
        for tokens in (CAPACITY, 5, 0):  # full, partial, none on this rank
            n = tokens if rank == 0 else max(0, tokens - 3)
            g = torch.Generator(device=device).manual_seed(100 * rank + tokens)
            x = torch.randn(n, DIM, device=device, generator=g).to(torch.bfloat16)
            ids = torch.rand(n, NUM_EXPERTS, device=device, generator=g).topk(TOP_K, 1).indices
            weights = torch.rand(n, TOP_K, device=device, generator=g)
            batch_g, out_g = _echo(gather, x, ids, weights)
            batch_s, out_s = _echo(symmetric, x, ids, weights)
            checks[f"rows {tokens}"] = torch.equal(batch_g.x, batch_s.x) and torch.equal(
                batch_g.topk_ids, batch_s.topk_ids
            )
            checks[f"sums {tokens}"] = torch.equal(out_g, out_s)
        # captured: the buffers exist (the eager steps above made them), so no allocation in the capture
        g = torch.Generator(device=device).manual_seed(7 + rank)
        x = torch.randn(CAPACITY, DIM, device=device, generator=g).to(torch.bfloat16)
        ids = torch.rand(CAPACITY, NUM_EXPERTS, device=device, generator=g).topk(TOP_K, 1).indices
        weights = torch.rand(CAPACITY, TOP_K, device=device, generator=g)
        eager = _echo(symmetric, x, ids, weights)[1]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _echo(symmetric, x, ids, weights)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _echo(symmetric, x, ids, weights)[1]
        graph.replay()
        torch.cuda.synchronize()
        checks["graph"] = torch.equal(captured, eager)
        dist.barrier()
        del graph
        dist.destroy_process_group()
        result = checks
    except BaseException:  # noqa: BLE001 (reported to the test through the result file)
        result = {"error": traceback.format_exc()}
    torch.save(result, out)


@pytest.mark.multi_gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
def test_symmetric_exchange_equals_the_all_gather_exchange_on_two_gpus(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_rank, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert "error" not in result, result.get("error")
        assert all(result.values()), (rank, result)
