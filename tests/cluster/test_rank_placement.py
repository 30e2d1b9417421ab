"""A worker's rank bundles as pure functions (`placement.rank_bundles`, `rank_placement`,
`ranks_unplaceable_reason`, `placement_violation`, `rank_channel`), and on real Ray clusters of simulated nodes on
this machine (`ray.cluster_utils.Cluster`, fake GPUs, NVLink-domain node labels): ranks of a STRICT_PACK worker
all on one node, ranks of an NVLink-domain worker spanning the nodes of one domain and never another's, joined
into a working rank group over both plan channels; placement alone on three simulated trays of two NVLink
domains, as on a GB200 NVL72 rack; and `pdserve serve` with a worker whose ranks span two nodes. Each Ray part
runs in one process (`_rank_cluster.py`), on one simulated cluster whose scenarios each get nodes of their own,
so that it never meets the session's local Ray; it is killed with its process group if it overruns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cluster import placement
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.placement import NVLINK_DOMAIN_LABEL as DOMAIN

CLUSTER_TIMEOUT_S = 420


def test_rank_bundles_one_gpu_each():
    assert placement.rank_bundles(3, 1, 4) == [{"CPU": 4.0, "GPU": 1.0}] * 3
    assert placement.rank_bundles(2, 0, 0.5) == [{"CPU": 0.5}] * 2
    for bad in [(0, 1, 1.0), (2, 2, 1.0), (2, 1, 0.0)]:
        with pytest.raises(ValueError):
            placement.rank_bundles(*bad)


def test_rank_placement_strategies():
    assert placement.rank_placement("node") == {"strategy": "STRICT_PACK"}
    assert placement.rank_placement("nvlink_domain") == {
        "topology_strategy": {"ray.io/node-id": "PACK", DOMAIN: "STRICT_PACK"}
    }
    with pytest.raises(ValueError, match="rank span 'rack'"):
        placement.rank_placement("rack")


def test_rank_channel_crosses_nodes_over_gloo():
    assert placement.rank_channel(["n1", "n1", "n1"]) == "shm"
    assert placement.rank_channel(["n1", "n1", "n2", "n2"]) == "dist"
    with pytest.raises(ValueError, match="at least one bundle"):
        placement.rank_channel([])


def test_rank_span_is_checked():
    assert ClusterConfig(rank_span="nvlink_domain").rank_span == "nvlink_domain"
    with pytest.raises(ValueError, match="rank_span='rack'"):
        ClusterConfig(rank_span="rack")


NODES = [{"CPU": 64, "GPU": 4}, {"CPU": 64, "GPU": 4}, {"CPU": 64, "GPU": 8}]
LABELS = [{DOMAIN: "a"}, {DOMAIN: "a"}, {DOMAIN: "b"}]


def test_unplaceable_per_node_and_per_domain():
    eight, twelve = placement.rank_bundles(8, 1, 8), placement.rank_bundles(12, 1, 8)
    assert placement.ranks_unplaceable_reason(eight, NODES, LABELS, "node") is None
    reason = placement.ranks_unplaceable_reason(twelve, NODES, LABELS, "node")
    assert "12 bundles" in reason and "best holds 8" in reason
    # 8 fit domain a (4 + 4 over two nodes) or b; 12 fit none; CPUs count too
    assert placement.ranks_unplaceable_reason(eight, NODES, LABELS, "nvlink_domain") is None
    reason = placement.ranks_unplaceable_reason(twelve, NODES, LABELS, "nvlink_domain")
    assert "'a': 8" in reason and "'b': 8" in reason
    hungry = placement.rank_bundles(8, 1, 32)
    assert "'a': 4" in placement.ranks_unplaceable_reason(hungry, NODES, LABELS, "nvlink_domain")
    unlabelled = placement.ranks_unplaceable_reason(eight, NODES, [{}, {}, {}], "nvlink_domain")
    assert DOMAIN in unlabelled


def test_placement_violation():
    labels = {"n1": {DOMAIN: "a"}, "n2": {DOMAIN: "a"}, "n3": {DOMAIN: "b"}, "n4": {}}
    assert placement.placement_violation(["n1", "n1"], labels, "node") is None
    assert "span nodes" in placement.placement_violation(["n1", "n2"], labels, "node")
    assert placement.placement_violation(["n1", "n2"], labels, "nvlink_domain") is None
    assert "domains ['a', 'b']" in placement.placement_violation(
        ["n1", "n3"], labels, "nvlink_domain"
    )
    assert "rank 1" in placement.placement_violation(["n1", "n4"], labels, "nvlink_domain")


@pytest.fixture(scope="module")
def simulated():
    """Each scenario's result by name, from one run of `_rank_cluster.py` (its own process and cluster: see the
    module docstring)."""
    here = Path(__file__).parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(here), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, str(here / "_rank_cluster.py")], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=CLUSTER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"simulated cluster still running after {CLUSTER_TIMEOUT_S} s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-5000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.ray
def test_ranks_land_per_strategy_on_a_simulated_ray_cluster(simulated):
    result = simulated["ranks"]
    nodes = result["nodes"]  # node id -> name (a1, a2, b1)

    for span, channel in (("node", "shm"), ("nvlink_domain", "dist")):
        rank_nodes = result[span]["rank_nodes"]
        assert placement.placement_violation(rank_nodes, result["labels"], span) is None, span
        # the placement group table a worker reads says where its ranks run, and so their channel
        assert result[span]["bundle_nodes"] == rank_nodes, span
        assert placement.rank_channel(rank_nodes) == channel, span
    packed = [nodes[n] for n in result["node"]["rank_nodes"]]
    assert packed == ["b1"] * 3, packed  # only b1 holds 3 GPUs on one node
    assert result["node"]["replies"] == [0, 1, 2]

    spread = [nodes[n] for n in result["nvlink_domain"]["rank_nodes"]]
    assert sorted(spread) == ["a1", "a1", "a2", "a2"], (
        spread
    )  # 4 GPUs: domain a's two nodes, never b1
    assert result["nvlink_domain"]["replies"] == [0, 1, 2, 3]
    assert "holds 5 bundles" in result["too_big"] and DOMAIN in result["too_big"]
    assert "'a': 4" in result["too_big"]
    assert result["leftover_groups"] == 0


@pytest.mark.ray
def test_a_rack_of_trays_on_a_simulated_ray_cluster(simulated):
    """Placement only, as on a GB200 NVL72 rack's trays: t1, t2 (4 fake GPUs each) form NVLink domain r0, t3
    is domain r1. An 8-rank worker takes both trays of r0, never t3; a 4-rank one then takes t3 (one node: the
    shared-memory channel); a 2-rank one fits a domain but finds none free, and fails once its placement
    timeout has passed; a 12-rank one fits no domain and is refused at once; the 2-rank one places in r0 once
    the 8-rank worker is gone."""
    result = simulated["trays"]
    nodes, labels, timeout_s = result["nodes"], result["labels"], result["timeout_s"]
    assert sorted(nodes.values()) == ["t1", "t2", "t3"]

    wide = result["wide"]
    assert sorted(nodes[n] for n in wide) == ["t1"] * 4 + ["t2"] * 4, wide
    assert placement.placement_violation(wide, labels, "nvlink_domain") is None
    assert placement.rank_channel(wide) == "dist"
    assert [nodes[n] for n in result["tray"]] == ["t3"] * 4
    assert placement.rank_channel(result["tray"]) == "shm"

    busy = result["busy"]
    assert f"not ready in {timeout_s} s" in busy["error"] and "held by others" in busy["error"]
    assert timeout_s <= busy["waited_s"] < CLUSTER_TIMEOUT_S
    too_big = result["too_big"]
    assert "holds 12 bundles" in too_big["error"], too_big
    assert "'r0': 8" in too_big["error"] and "'r1': 4" in too_big["error"]
    assert too_big["waited_s"] < timeout_s  # refused before any wait
    after = [nodes[n] for n in result["after"]["bundle_nodes"]]
    assert len(after) == 2 and set(after) <= {"t1", "t2"}, after
    assert result["leftover_groups"] == 0


@pytest.mark.slow
@pytest.mark.ray
def test_a_worker_serves_with_its_ranks_on_two_nodes_of_a_domain(simulated):
    """`pdserve serve` with cluster.rank_span nvlink_domain: a decode worker of 2 CPU ranks (DP2 + EP2) on two
    simulated nodes of one domain with one CPU each (so one rank each; span 'node' could not place it) serves
    greedy tokens equal to the offline path's."""
    result = simulated["serve"]
    nodes = result["nodes"]
    assert sorted(nodes[n] for n in result["bundle_nodes"]) == ["d1", "d2"]
    assert placement.rank_channel(result["bundle_nodes"]) == "dist"
    assert result["served"] == result["offline"]
    assert all(result["served"])
    assert result["leftover_groups"] == 0
