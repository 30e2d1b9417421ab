"""Ranks in their own OS processes for tests, joined by a gloo group through a FileStore (`spawn_gloo`, bounded
by a timeout). `run_ranks` runs one parallel layout of the model: each rank loads its share of the checkpoint, runs
a prefill step and a decode step over the requests given to it (a rank with none runs `forward_idle`, joining the
expert exchange with no tokens) and returns its logits, its resident routed-expert bytes and the names of the
tensors its loader read."""

from __future__ import annotations

import dataclasses
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from pdserve.engine.ranks.group import rank_process_context

_CTX = rank_process_context()  # forked from a server that imported torch once
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


def run_steps(
    model, requests: list[Request], num_pages: int, decoding: set[int] | None = None
) -> dict[str, dict[int, torch.Tensor]]:
    """A prefill step of `requests`, then a decode step of those in `decoding` (None: all) followed by the
    MTP module on the decode step's hidden states; logits per step and request index. A step with no requests
    is an idle step (`forward_idle`, `mtp_idle`)."""
    from pdserve.model.batch import SeqChunk, build_forward_batch
    from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache

    layout = KVCacheLayout.for_model(model.args, PAGE_SIZE, torch.float32, model.num_mtp)
    cache = PagedKVCache(layout, num_pages, "cpu")
    out: dict[str, dict[int, torch.Tensor]] = {"prefill": {}, "decode": {}, "mtp": {}}
    for step in ("prefill", "decode"):
        mine = [r for r in requests if step == "prefill" or decoding is None or r.index in decoding]
        if not mine:
            model.forward_idle()
            if step == "decode" and model.num_mtp:
                model.mtp_idle(0)
            continue
        chunks = [
            SeqChunk(r.prompt, 0, pages_of(r.index, len(r.prompt)))
            if step == "prefill"
            else SeqChunk([r.next_token], len(r.prompt), pages_of(r.index, len(r.prompt)))
            for r in mine
        ]
        batch = build_forward_batch(chunks, PAGE_SIZE, "cpu", decode=step == "decode")
        hidden = model(batch, cache)
        logits = model.compute_logits(hidden[batch.logits_indices])
        for row, r in enumerate(mine):
            out[step][r.index] = logits[row].clone()
        if step == "decode" and model.num_mtp:
            draft_ids = torch.tensor([r.next_token + 1 for r in mine])
            _, mtp_logits = model.mtp_logits(0, hidden, draft_ids, batch, cache)
            for row, r in enumerate(mine):
                out["mtp"][r.index] = mtp_logits[row].clone()
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


def _entry(target, rank, world, store_path, args, out_dir):
    """A rank process: joins the gloo group, runs `target(rank, world, *args)`, saves its result (or the
    traceback) for the parent."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
        result = target(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (reported to the test through the result file)
        result = {"error": traceback.format_exc()}
    torch.save(result, out)


def spawn_gloo(tmp_path: Path, target, args_by_rank: list[tuple]) -> list:
    """Runs `target(rank, world, *args_by_rank[rank])` in one process per rank, joined by a gloo group, and
    returns each rank's result; raises if a rank failed or is still running after JOIN_TIMEOUT_S."""
    world = len(args_by_rank)
    store_path = str(tmp_path / "store")
    procs = [
        _CTX.Process(
            target=_entry, args=(target, rank, world, store_path, args_by_rank[rank], str(tmp_path))
        )
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
    results, errors = [], []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.pt"
        if not path.is_file():
            errors.append(f"rank {rank} exited with {procs[rank].exitcode} and no result")
            continue
        result = torch.load(path)
        if isinstance(result, dict) and "error" in result:
            errors.append(f"rank {rank} failed:\n{result['error']}")
        results.append(result)
    if errors:
        raise RuntimeError("\n".join(errors))
    return results


def _model_rank(rank, world, ckpt, layout_kwargs, requests, decoding, num_pages):
    from pdserve.model import loader
    from pdserve.model.parallel import ParallelLayout, WorkerLayout

    worker_keys = {f.name for f in dataclasses.fields(WorkerLayout)}
    worker = WorkerLayout(world, **{k: v for k, v in layout_kwargs.items() if k in worker_keys})
    options = {k: v for k, v in layout_kwargs.items() if k not in worker_keys}
    layout = ParallelLayout(worker, rank=rank, **options)
    read_log = _ReadLog(loader.safe_open)
    loader.safe_open = read_log
    try:
        model = loader.load_model(ckpt, dtype=torch.float32, progress=False, layout=layout)
    finally:
        loader.safe_open = read_log.safe_open
    dummy = loader.load_model(ckpt, dtype=torch.float32, layout=layout, load_format="dummy", seed=0)
    dummy_params = dict(dummy.named_parameters())
    same_as_dummy = all(torch.equal(p, dummy_params[n]) for n, p in model.named_parameters())
    # routed slots only: a layer with a fused shared expert stacks it after them
    num_local = len(layout.local_experts(model.args.n_routed_experts))
    expert_bytes = sum(
        p[:num_local].numel() * p.element_size()
        for n, p in model.named_parameters()
        if ".ffn.experts." in n
    )
    return {
        "logits": run_steps(model, requests, num_pages, decoding), "expert_bytes": expert_bytes,
        "reads": read_log.reads, "same_as_dummy": same_as_dummy,
    }  # fmt: skip


def run_ranks(
    tmp_path: Path, ckpt: Path, layout_kwargs: dict, requests_by_rank: list[list[Request]],
    decoding: set[int], num_pages: int,
) -> list[dict]:  # fmt: skip
    """One process per rank of the layout, each loading its share of `ckpt` and running its requests
    (`run_steps`)."""
    args = [(str(ckpt), layout_kwargs, mine, decoding, num_pages) for mine in requests_by_rank]
    return spawn_gloo(tmp_path, _model_rank, args)
