"""The ranks of one parallel layout in their own OS processes for tests: each joins a gloo group through a
FileStore, loads its share of the checkpoint, runs a prefill step and a decode step over the requests given to it
(a rank with none runs `forward_idle`, joining the expert exchange with no tokens), and saves its logits, its
resident routed-expert bytes and the names of the tensors its loader read to a file for the test."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

_CTX = mp.get_context("spawn")
PAGE_SIZE = 16
JOIN_TIMEOUT_S = 240


@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    prompt: list[int]
    next_token: int
    """The token fed to the decode step."""


def pages_of(index: int, prompt_len: int) -> list[int]:
    """Disjoint pages per request index, enough for the prompt and one decode token."""
    per_request = -(-(prompt_len + 1) // PAGE_SIZE)
    return list(range(index * 8, index * 8 + per_request))


def run_steps(model, requests: list[Request], num_pages: int) -> dict[str, dict[int, torch.Tensor]]:
    """Prefill then one decode step of `requests` on `model`; logits per request index. With none, the two
    steps are idle steps."""
    from pdserve.model.batch import SeqChunk, build_forward_batch
    from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache

    layout = KVCacheLayout.for_model(model.args, PAGE_SIZE, torch.float32, model.num_mtp)
    cache = PagedKVCache(layout, num_pages, "cpu")
    out: dict[str, dict[int, torch.Tensor]] = {"prefill": {}, "decode": {}}
    for step in ("prefill", "decode"):
        if not requests:
            model.forward_idle()
            continue
        chunks = [
            SeqChunk(r.prompt, 0, pages_of(r.index, len(r.prompt)))
            if step == "prefill"
            else SeqChunk([r.next_token], len(r.prompt), pages_of(r.index, len(r.prompt)))
            for r in requests
        ]
        batch = build_forward_batch(chunks, PAGE_SIZE, "cpu", decode=step == "decode")
        logits = model.compute_logits(model(batch, cache)[batch.logits_indices])
        for row, r in enumerate(requests):
            out[step][r.index] = logits[row].clone()
    return out


class _ReadLog:
    """Wraps safetensors' `safe_open` and records the tensors whose data is read (`get_tensor`, or indexing a
    `get_slice`); headers (`keys`, slice shapes and dtypes) are not reads."""

    def __init__(self, safe_open):
        self.safe_open = safe_open
        self.reads: list[tuple[str, str]] = []

    def __call__(self, *args, **kwargs):
        log = self

        class Handle:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                self.inner = self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_tensor(self, name):
                log.reads.append((name, "whole"))
                return self.inner.get_tensor(name)

            def get_slice(self, name):
                sl = self.inner.get_slice(name)

                class Slice:
                    def get_dtype(self):
                        return sl.get_dtype()

                    def get_shape(self):
                        return sl.get_shape()

                    def __getitem__(self, index):
                        log.reads.append((name, "slice"))
                        return sl[index]

                return Slice()

        return Handle(self.safe_open(*args, **kwargs))


def _rank_main(rank, world, store_path, ckpt, layout_kwargs, requests, num_pages, out_dir):
    import torch.distributed as dist

    from pdserve.model import loader
    from pdserve.model.parallel import ParallelLayout

    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
        layout = ParallelLayout(world_size=world, rank=rank, **layout_kwargs)
        read_log = _ReadLog(loader.safe_open)
        loader.safe_open = read_log
        model = loader.load_model(ckpt, dtype=torch.float32, progress=False, layout=layout)
        loader.safe_open = read_log.safe_open
        dummy = loader.load_model(
            ckpt, dtype=torch.float32, layout=layout, load_format="dummy", seed=0
        )
        same_as_dummy = all(
            torch.equal(p, dict(dummy.named_parameters())[n]) for n, p in model.named_parameters()
        )
        # routed slots only: a layer with a fused shared expert stacks it after them
        num_local = len(layout.local_experts(model.args.n_routed_experts))
        expert_bytes = sum(
            p[:num_local].numel() * p.element_size()
            for n, p in model.named_parameters()
            if ".ffn.experts." in n
        )
        logits = run_steps(model, requests, num_pages)
        dist.barrier()
        result = {
            "logits": logits, "expert_bytes": expert_bytes, "reads": read_log.reads,
            "same_as_dummy": same_as_dummy,
        }  # fmt: skip
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (reported to the test through the result file)
        result = {"error": traceback.format_exc()}
    torch.save(result, out)


def run_ranks(
    tmp_path: Path, ckpt: Path, layout_kwargs: dict, requests_by_rank: list[list[Request]],
    num_pages: int,
) -> list[dict]:  # fmt: skip
    """Runs one process per rank and returns each rank's result; raises if a rank failed or hung."""
    world = len(requests_by_rank)
    store_path = str(tmp_path / "store")
    procs = [
        _CTX.Process(
            target=_rank_main,
            args=(rank, world, store_path, str(ckpt), layout_kwargs, requests_by_rank[rank],
                  num_pages, str(tmp_path)),
        )  # fmt: skip
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join()
    if hung:
        raise TimeoutError(f"ranks {hung} still running after {JOIN_TIMEOUT_S} s")
    results = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.pt"
        if not path.is_file():
            raise RuntimeError(f"rank {rank} exited with {procs[rank].exitcode} and no result")
        result = torch.load(path)
        if "error" in result:
            raise RuntimeError(f"rank {rank} failed:\n{result['error']}")
        results.append(result)
    return results
