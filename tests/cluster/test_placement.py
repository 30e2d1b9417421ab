"""Placement as pure functions over resource tables."""

from __future__ import annotations

from pdserve.cluster import placement


def test_one_strict_pack_bundle_per_worker():
    assert placement.STRATEGY == "STRICT_PACK"
    assert placement.worker_bundles(8, 4.0) == [{"CPU": 4.0, "GPU": 8.0}]
    assert placement.worker_bundles(0, 0.25) == [{"CPU": 0.25}]


def test_gpus_per_worker_default_follows_the_cluster():
    assert placement.resolve_gpus_per_worker(None, {"CPU": 16, "GPU": 8}) == 1
    assert placement.resolve_gpus_per_worker(None, {"CPU": 2}) == 0
    assert placement.resolve_gpus_per_worker(4, {"CPU": 2}) == 4


def test_unplaceable_when_no_single_node_is_big_enough():
    nodes = [{"CPU": 64, "GPU": 4}, {"CPU": 64, "GPU": 4}]  # 8 GPUs, but 4 per node
    reason = placement.unplaceable_reason(placement.worker_bundles(8, 1), nodes)
    assert reason is not None and "GPU" in reason
    assert placement.unplaceable_reason(placement.worker_bundles(4, 1), nodes) is None


def test_fits_now_and_threads():
    assert placement.fits_now([{"CPU": 1.0}], {"CPU": 1.5})
    assert not placement.fits_now([{"CPU": 1.0, "GPU": 1.0}], {"CPU": 8.0})
    assert placement.cpu_threads(0.25) == 1 and placement.cpu_threads(6.0) == 6
