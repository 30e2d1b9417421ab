"""The host tier on the tiny fp32 model (CPU): an aggregated decode worker whose prompt's cached pages were
evicted to the host pool (some, the rest still on the GPU; or most) finds them there, restores them into its
pages (every layer's rows, the MTP layer's included, fp8 rows as bytes) and gets the tokens and
log-probabilities of a worker without any cache; the runner's copies move every byte of a page and back; a
size below one page, and a worker of several ranks, are refused."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.decode import DecodeConfig, DecodeWorker
from pdserve.engine.host_store import HostKVStore, host_slots
from pdserve.engine.host_tier import OFFLOAD, RESTORE, HostCopy
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.worker import host_tier_counts
from pdserve.model.errors import ConfigError

from .test_prefix_cache_model import PAGE, assert_same_outputs, prompt_ids, serve

SHORT = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=2, seed=1)


@pytest.mark.parametrize("num_drafts, kv_cache_dtype", [(0, "auto"), (2, "auto"), (0, "fp8")])
def test_hits_from_the_host_give_the_outputs_of_no_cache(
    reference_model, num_drafts, kv_cache_dtype
):
    def worker(caching: bool) -> DecodeWorker:
        config = DecodeConfig(
            page_size=PAGE, num_pages=12 if caching else 96, max_prefill_chunk=16,
            enable_prefix_caching=caching,
            num_speculative_tokens=num_drafts, speculative_min_acceptance=0.0,
            host_kv_cache_bytes=(1 << 24) if caching else 0,
        )  # fmt: skip
        return DecodeWorker("d0", reference_model, config, kv_cache_dtype=kv_cache_dtype)

    cached, plain = worker(True), worker(False)
    assert cached.runner.host_store is not None and plain.runner.host_store is None
    # one after another on the tiered worker: a prompt; another whose pages evict some of the first's to
    # the host; the first again (GPU hit, then host); a third that evicts more; the first once more
    # (mostly host). The worker without a cache runs them all in one batch.
    base = prompt_ids(22, 0)
    got, requests, restored = {}, [], {}
    for rid, prompt in (
        ("a", base), ("other", prompt_ids(36, 1)), ("again", base), ("third", prompt_ids(40, 3)),
        ("once more", base),
    ):  # fmt: skip
        before = cached.scheduler.host_pools[0].num_restored
        got |= serve(cached, [(rid, prompt, SHORT)])
        restored[rid] = cached.scheduler.host_pools[0].num_restored - before
        requests.append((rid, prompt, SHORT))
    want = serve(plain, requests)
    reported = {rid: c for rid, (_, _, c) in got.items()}
    assert reported["a"] == 0 and reported["again"] == reported["once more"] == 20
    # again: its first pages still on the GPU, the rest from the host; once more: mostly from the host
    assert 0 < restored["again"] < 5 and restored["once more"] >= 3
    pool = cached.scheduler.host_pools[0]
    assert cached.runner.host_store.bytes_copied >= (pool.num_offloaded + pool.num_restored) * (
        cached.runner.cache.layout.page_bytes
    )
    assert_same_outputs(got, want, 2e-2 if kv_cache_dtype == "fp8" else 1e-4)
    counts = host_tier_counts(cached)
    assert counts["host_kv_restored_pages"] == pool.num_restored == sum(restored.values())
    assert counts["host_kv_bytes_copied"] == cached.runner.host_store.bytes_copied
    assert host_tier_counts(plain) == dict.fromkeys(counts, 0)
    pool.check()
    cached.allocator.check()
    assert cached.stats().pages_used == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_copies_move_every_byte_of_a_page_and_back(reference_model, kv_cache_dtype):
    runner = ModelRunner(reference_model, PAGE, 8, kv_cache_dtype, cuda_graphs=False)
    cache = runner.cache
    cache.data.view(torch.uint8).copy_(
        torch.randint(0, 256, cache.data.view(torch.uint8).shape, dtype=torch.uint8)
    )
    store = HostKVStore(cache, 4)
    before = cache.data.clone()
    store.run([HostCopy(OFFLOAD, 2, 0), HostCopy(OFFLOAD, 3, 1), HostCopy(OFFLOAD, 7, 3)])
    store.run([HostCopy(RESTORE, 0, 0), HostCopy(RESTORE, 1, 1), HostCopy(RESTORE, 5, 3)])
    assert torch.equal(cache.data[:2].view(torch.uint8), before[2:4].view(torch.uint8))
    assert torch.equal(cache.data[5].view(torch.uint8), before[7].view(torch.uint8))
    assert store.bytes_copied == 6 * cache.layout.page_bytes
    assert host_slots(10 * cache.layout.page_bytes + 1, cache.layout.page_bytes) == 10
    with pytest.raises(ValueError, match="host KV cache bytes=-1"):
        host_slots(-1, 64)
    with pytest.raises(ValueError, match="host KV cache bytes=63: less than one KV page"):
        host_slots(63, 64)
    assert host_slots(0, 64) == 0
    with pytest.raises(ValueError, match="host_kv_cache_bytes=-1"):
        DecodeConfig(host_kv_cache_bytes=-1)


def test_a_worker_of_several_ranks_refuses_the_host_tier():
    ranks = types.SimpleNamespace(world_size=2)  # refused before the group is used
    config = DecodeConfig(page_size=PAGE, num_pages=8, host_kv_cache_bytes=1 << 20)
    with pytest.raises(ConfigError, match="host_kv_cache_bytes=1048576 with ranks=2"):
        DecodeWorker("d0", None, config, ranks=ranks)
