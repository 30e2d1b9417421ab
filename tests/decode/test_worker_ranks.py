"""A decode worker of 2 CPU ranks (the driver and one spawned rank process, gloo), with data-parallel attention and
expert-parallel MoE or with tensor-parallel attention and dense layers: aggregated requests (spread over both
ranks under data-parallel attention) stream the tokens `pdserve offline` generates on one process; killing the
other rank's process fails every request with an error naming it, frees every page and ends the worker's
loop."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest
import torch

from pdserve.decode import DecodeConfig, DecodeWorker
from pdserve.engine.messages import DecodeRequest, PrefillRequest
from pdserve.engine.offline import OfflineGenerator
from pdserve.engine.ranks.runner import start_rank_group
from pdserve.engine.worker import RanksFailedError
from pdserve.kvtransfer import KVTransferConfig
from pdserve.kvtransfer.dist import DistKVSender, connect_store
from pdserve.kvtransfer.store import new_secret
from pdserve.model.loader import load_model
from pdserve.model.parallel import WorkerLayout
from pdserve.model.random_checkpoint import make_checkpoint
from pdserve.prefill import PrefillConfig, PrefillWorker

from .test_worker import PAGE, PARAMS, PROMPTS, assert_speculated, drain, offline

# its tests start processes of their own
pytestmark = pytest.mark.subprocess

SECRET = new_secret()
CONFIG = DecodeConfig(
    page_size=PAGE, num_pages=32, max_prefill_chunk=4, cuda_graphs=False,
    layout=WorkerLayout(2, "data", expert_parallel=2),
)  # fmt: skip
TP2 = dataclasses.replace(CONFIG, layout=WorkerLayout(2, "tensor", dense="tensor"))
BALANCED = dataclasses.replace(
    CONFIG,
    layout=WorkerLayout(2, "data", expert_parallel=2, redundant_experts=2, rebalance_steps=2),
)
"""A spare slot a rank, placed every 2 steps: copies of hot experts move between steps while requests run."""
OVERLAP = dataclasses.replace(
    CONFIG, layout=WorkerLayout(2, "data", expert_parallel=2, overlap_rows=2)
)
"""Decode steps of 2 rows a rank or more as two micro-batches (a rank with one row, or none, joins both)."""
MTP = {"num_speculative_tokens": 2}
"""Speculation: every rank joins the MTP passes' exchanges (a rank without rows too)."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    return make_checkpoint(out, "tiny", dtype="fp32", shard_bytes=2 << 20, progress=False)


def worker(ckpt, config=CONFIG) -> DecodeWorker:
    group = start_rank_group(config, str(ckpt), "fp32", "auto")
    return DecodeWorker("d0", None, config, ranks=group)


@pytest.mark.parametrize(
    "config",
    [
        CONFIG,
        TP2,
        dataclasses.replace(CONFIG, **MTP),
        dataclasses.replace(TP2, **MTP),
        BALANCED,
        OVERLAP,
        dataclasses.replace(OVERLAP, **MTP),
    ],
    ids=[
        "dp2-ep2",
        "tp2",
        "dp2-ep2-mtp2",
        "tp2-mtp2",
        "dp2-ep2-balanced",
        "dp2-ep2-overlap",
        "dp2-ep2-overlap-mtp2",
    ],
)
def test_requests_give_the_offline_tokens(ckpt, config):
    decode = worker(ckpt, config)
    try:
        for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
            decode.add_request(DecodeRequest(f"r{i}", prompt, params))
        ranks = {r.request_id: r.rank for r in decode.scheduler.requests.values()}
        ffn = decode.model.layers[-1].ffn
        routed = ffn.experts.w2.shape[0] - int(ffn.fused_shared) - ffn.slots.spares
        if config.layout.attention == "data":
            assert set(ranks.values()) == {0, 1}, ranks  # both ranks hold requests
            assert (
                routed * 2 == decode.model.args.n_routed_experts
            )  # the driver holds half the experts
        else:
            assert decode.model.layers[0].attn.n_heads * 2 == decode.model.args.num_attention_heads
        got = drain(decode, ["r0", "r1", "r2"])
        if config.layout.redundant_experts:  # the ranks placed copies and moved them, as stats say
            stats = decode.stats()
            assert stats.expert_rebalances >= 2 and stats.expert_slots_moved > 0
            assert 0 < stats.expert_balancedness <= 1
        data_parallel = config.layout.attention == "data"
        pages = 2 * 32 if data_parallel else 32  # one allocator per data-parallel rank
        assert decode.num_used_pages == 0 and decode.num_pages == pages
    finally:
        decode.close()
    want = offline(load_model(ckpt, dtype=torch.float32))
    if config.num_speculative_tokens:
        assert_speculated(got, want)
        assert decode.scheduler.spec_stats.drafted > 0
    else:
        assert got == want


def test_a_killed_rank_fails_every_request_and_frees_every_page(ckpt):
    decode = worker(ckpt)
    try:
        for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
            decode.add_request(DecodeRequest(f"r{i}", prompt, params))
        assert decode.step()
        os.kill(decode.ranks.launcher.procs[0].pid, signal.SIGKILL)
        errors: dict[str, str] = {}
        for _ in range(10):
            decode.step()
            for out in decode.poll_outputs():
                if out.error is not None:
                    errors[out.request_id] = out.error
            if decode.failed:
                break
        assert set(errors) == {"r0", "r1", "r2"}
        assert all("rank group failed" in e and "ranks [1]" in e for e in errors.values()), errors
        assert decode.num_used_pages == 0 and not decode.scheduler.requests
        with pytest.raises(RanksFailedError, match="ranks \\[1\\]"):
            decode.run(threading.Event())
        assert not decode.ranks.launcher.procs[0].is_alive()
    finally:
        decode.close()


@pytest.fixture
def kv_store():
    """The deployment's KV rendezvous store, hosted here on a free port; yields its config."""
    config = KVTransferConfig(store_port=0, timeout_s=20, connect_timeout_s=20)
    store = connect_store(config, is_master=True, secret=SECRET)
    yield dataclasses.replace(config, store_port=store.raw.port)
    del store


def test_disaggregated_requests_land_on_their_ranks_and_give_the_offline_tokens(ckpt, kv_store):
    """A prefill worker sends each request's pages to the decode rank that holds it (its reservation names the
    rank's endpoint); a request cancelled while its KV is awaited on rank 1 frees its pages once the rank has
    cancelled, and the ranks go on receiving; a request's next turn goes to the rank that holds its pages and
    receives only the others."""
    kv = {"config": dataclasses.asdict(kv_store), "worker_id": "d0", "store_secret": SECRET}
    decode = DecodeWorker(
        "d0", None, CONFIG, ranks=start_rank_group(CONFIG, str(ckpt), "fp32", "auto", kv=kv)
    )
    model = load_model(ckpt, dtype=torch.float32)
    sender = DistKVSender(
        kv_store, connect_store(kv_store, False, SECRET), "p0", torch.device("cpu")
    )
    prefill = PrefillWorker("p0", model, PrefillConfig(page_size=PAGE, num_pages=32), sender)
    try:
        endpoints = {}
        for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
            reservation = decode.add_request(DecodeRequest(f"r{i}", prompt, params, "p0"))
            endpoints[f"r{i}"] = reservation.endpoint
            prefill.submit(
                PrefillRequest(
                    f"r{i}", prompt, params, 0, reservation.endpoint, reservation.transfer_id,
                    num_held_pages=reservation.num_held_pages,
                )
            )  # fmt: skip
        assert sorted(set(endpoints.values())) == ["d0.r0", "d0.r1"], endpoints
        # Cancelled while awaited on rank 1 (told to the rank with the next round): pages held until then.
        late = decode.add_request(DecodeRequest("late", PROMPTS[1], PARAMS[1], "p0"))
        assert late.endpoint == "d0.r1", late
        assert decode.step() is not None
        used = decode.num_used_pages
        decode.abort("late")
        assert decode.num_used_pages == used  # rank 1 was told to expect it: held until it cancels
        assert [(o.request_id, o.finish_reason) for o in decode.poll_outputs()] == [
            ("late", "abort")
        ]
        got = drain(decode, ["r0", "r1", "r2"], prefill)
        decode.step()
        assert decode.num_used_pages == 0 and not decode.rank_kv.awaited
        # r1's next turn goes to the rank that holds r1's pages, and only the pages after them travel
        # 23 tokens: r1's 19 computed ones (4 full pages, held), 3 more
        turn = [*PROMPTS[1], *got["r1"][0], 5, 6, 7]
        reservation = decode.add_request(DecodeRequest("turn", turn, PARAMS[0], "p0"))
        assert (reservation.endpoint, reservation.num_held_pages) == (endpoints["r1"], 4)
        prefill.submit(
            PrefillRequest(
                "turn", turn, PARAMS[0], 0, reservation.endpoint, reservation.transfer_id,
                num_held_pages=4,
            )
        )  # fmt: skip
        turn_got = drain(decode, ["turn"], prefill)["turn"]
        decode.step()
        assert decode.num_used_pages == 0 and prefill.stats().kv_pages_not_sent == 4
    finally:
        prefill.close()
        decode.close()
    assert got == offline(model)
    want = OfflineGenerator(model, PAGE).generate(turn, PARAMS[0])
    assert turn_got == (want.token_ids, want.finish_reason)
    assert prefill.poll_failures() == []
    assert prefill.stats().pages_used == 0
