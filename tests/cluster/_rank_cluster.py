"""Run by test_rank_placement as its own process: three scenarios one after another on one simulated Ray cluster,
each on nodes of its own (added before it runs, removed after); prints one JSON line.

`ranks`: a Ray cluster of three simulated nodes (a1, a2 in NVLink domain 'a' with 2 fake GPUs each,
b1 in domain 'b' with 3), one worker's rank group placed on it per span, the driver being this process: each
node's name by id, and per span where the ranks landed and what they replied; then the reason a 5-rank domain
worker is refused. Also the handler the rank actors run (this folder is on their PYTHONPATH).

`serve`: `pdserve serve`'s router in this process and one aggregated decode worker of 2 CPU ranks (DP2 + EP2,
the tiny model) with rank_span nvlink_domain on two nodes d1, d2 of one domain with one CPU each, so that its
ranks must span both: each request's greedy tokens beside the offline path's, and the nodes of the worker's
bundles.

`trays`: placement only (no rank processes), on a rack-like cluster: trays t1, t2 of NVLink domain r0 and t3 of
r1 (4 fake GPUs each) and u1, an unlabelled node of 8. Where each worker's bundles landed, in order: 8 ranks over
a domain, 4 ranks over a domain, 8 ranks on one node; then a 2-rank domain worker that fits no free domain
(times out), a 12-rank one that fits no domain (refused at once), and the 2-rank one again once the first
worker is gone."""

from __future__ import annotations

import json
import logging


def where(ctx):
    import ray

    def handle(plan):
        return {"rank": ctx.rank, "node": ray.get_runtime_context().get_node_id()}

    return handle


def run_worker(span: str, num_ranks: int, channel: str) -> dict:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pdserve.cluster.rank_actors import RayRankLauncher, bundle_nodes, make_rank_placement_group
    from pdserve.engine.ranks.group import RankGroup, RankGroupConfig
    from pdserve.engine.ranks.process import HandlerSpec

    cpus = 0.5
    group = make_rank_placement_group(num_ranks, 1, cpus, span, timeout_s=60)
    try:
        # bundle 0 is the driver's (the worker actor in production): where would it run?
        probe = ray.remote(num_cpus=cpus, num_gpus=1)(
            lambda: ray.get_runtime_context().get_node_id()
        )
        driver_node = ray.get(
            probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote(),
            timeout=60,
        )
        config = RankGroupConfig(
            num_ranks, channel=channel, store_host=ray.util.get_node_ip_address(),
            join_timeout_s=180, step_timeout_s=60,
        )  # fmt: skip
        launcher = RayRankLauncher(group, 1, cpus)
        with RankGroup(config, HandlerSpec("_rank_cluster:where"), launcher) as ranks:
            replies = ranks.step({})
            actor_nodes = launcher.rank_nodes(timeout_s=60)
        assert [r["node"] for r in replies[1:]] == actor_nodes
        return {
            "rank_nodes": [driver_node, *actor_nodes], "bundle_nodes": bundle_nodes(group),
            "replies": [r["rank"] for r in replies],
        }  # fmt: skip
    finally:
        ray.util.remove_placement_group(group)


RANK_NODES = (("a1", "a", 2, 2), ("a2", "a", 2, 2), ("b1", "b", 3, 2))
"""(name, NVLink domain, fake GPUs, CPUs) of each simulated node of the `ranks` scenario, beside a head
that holds nothing."""
TRAYS = (("t1", "r0", 4, 2), ("t2", "r0", 4, 2), ("t3", "r1", 4, 2))
"""The `trays` scenario's nodes."""
TRAY_CPUS_PER_RANK = 0.5
TRAY_TIMEOUT_S = 3.0


def _attempt(num_ranks: int, span: str) -> dict:
    """Places a worker's ranks (then frees them): where its bundles went, or the error and how long it took."""
    import time

    import ray

    from pdserve.cluster.errors import UnavailableError
    from pdserve.cluster.rank_actors import bundle_nodes, make_rank_placement_group

    start = time.monotonic()
    try:
        group = make_rank_placement_group(
            num_ranks, 1, TRAY_CPUS_PER_RANK, span, timeout_s=TRAY_TIMEOUT_S
        )
    except UnavailableError as e:
        return {"error": str(e), "waited_s": time.monotonic() - start}
    nodes = bundle_nodes(group)
    ray.util.remove_placement_group(group)
    return {"bundle_nodes": nodes}


def trays() -> dict:
    import ray

    from pdserve.cluster.rank_actors import bundle_nodes, make_rank_placement_group

    result: dict = {"timeout_s": TRAY_TIMEOUT_S}
    held = {}
    for key, num_ranks in (("wide", 8), ("tray", 4)):
        held[key] = make_rank_placement_group(
            num_ranks, 1, TRAY_CPUS_PER_RANK, "nvlink_domain", timeout_s=30
        )
        result[key] = bundle_nodes(held[key])
    result["busy"] = _attempt(2, "nvlink_domain")
    result["too_big"] = _attempt(12, "nvlink_domain")
    ray.util.remove_placement_group(held.pop("wide"))
    result["after"] = _attempt(2, "nvlink_domain")
    ray.util.remove_placement_group(held.pop("tray"))
    return result


SERVE_NODES = (("d1", "d", 0, 1), ("d2", "d", 0, 1))
SERVE_REQUESTS = (([0, 5, 9, 14, 3], 6), ([0, *range(20, 70)], 5), ([0, 7], 8))


def serve() -> dict:
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import ray
    import torch

    from pdserve.cli.client import Client, generate_request
    from pdserve.cluster.config import build_config
    from pdserve.engine.offline import generate_greedy
    from pdserve.frontend.server import ServerThread, free_port
    from pdserve.model.loader import load_model
    from pdserve.model.random_checkpoint import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(Path(tmp) / "tiny", "tiny", dtype="fp32", progress=False)
        layout = {"ranks": 2, "attention": "data", "expert_parallel": 2}
        config = build_config(None, {
            "model": {"path": str(model_dir), "dtype": "fp32"},
            "cluster": {
                "num_prefill": 0, "num_decode": 1, "gpus_per_worker": 0, "cpus_per_worker": 1.0,
                "rank_span": "nvlink_domain", "placement_timeout_s": 60.0, "load_timeout_s": 180.0,
            },
            "router": {"port": 0, "http_port": None, "stats_interval_s": 0.0},
            "prefill": {"page_size": 16},
            "decode": {"num_pages": 128, "page_size": 16, "max_prefill_chunk": 128,
                       "max_num_batched_tokens": 512, **layout},
            "kvtransfer": {"store_port": free_port(), "connect_timeout_s": 20.0},
        })  # fmt: skip
        with ServerThread(config) as server, Client(server.address) as client:
            [group] = [g for g in ray.util.placement_group_table().values()
                       if g["name"].endswith("-decode-0") and g["state"] == "CREATED"]  # fmt: skip

            def generate(request) -> list[int]:
                prompt, max_tokens = request
                call = generate_request(
                    prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                )
                return [t for c in client.generate(call, timeout_s=120) for t in c.token_ids]

            with ThreadPoolExecutor(len(SERVE_REQUESTS)) as pool:
                served = list(pool.map(generate, SERVE_REQUESTS))
        model = load_model(model_dir, dtype=torch.float32, progress=False)
        offline = [generate_greedy(model, p, n) for p, n in SERVE_REQUESTS]
    bundles = group["bundles_to_node_id"]
    return {
        "bundle_nodes": [bundles[i] for i in range(len(bundles))],
        "served": served, "offline": offline,
    }  # fmt: skip


def ranks() -> dict:
    from pdserve.cluster.errors import UnavailableError
    from pdserve.cluster.rank_actors import make_rank_placement_group

    result = {"node": run_worker("node", 3, "shm")}
    result["nvlink_domain"] = run_worker("nvlink_domain", 4, "dist")
    try:
        make_rank_placement_group(5, 1, 0.5, "nvlink_domain", timeout_s=10)
        result["too_big"] = "placed"
    except UnavailableError as e:
        result["too_big"] = str(e)
    return result


SCENARIOS = {"ranks": (RANK_NODES, ranks), "trays": (TRAYS, trays), "serve": (SERVE_NODES, serve)}
"""Per scenario: its nodes and what runs on the cluster while they are up."""


def main() -> None:
    """Runs the scenarios named in argv (all by default) one after another on one simulated cluster: a head that
    holds nothing, and for each scenario its own nodes, added before it runs and removed after, so that no
    scenario sees another's. Prints one JSON object: each scenario's result by name."""
    import sys
    import time

    import ray
    from ray.cluster_utils import Cluster

    from pdserve.cluster.placement import NVLINK_DOMAIN_LABEL
    from pdserve.cluster.rank_actors import node_labels

    names = sys.argv[1:] or list(SCENARIOS)
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    results = {}
    try:
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        for scenario_name in names:
            nodes, scenario = SCENARIOS[scenario_name]
            added = {}
            for name, domain, gpus, cpus in nodes:
                labels = {NVLINK_DOMAIN_LABEL: domain}
                node = cluster.add_node(num_cpus=cpus, num_gpus=gpus, labels=labels)
                added[node.node_id] = (name, node)
            cluster.wait_for_nodes()
            result = {"nodes": {i: name for i, (name, _) in added.items()}}
            result |= {"labels": node_labels(), **scenario()}
            table = ray.util.placement_group_table()
            result["leftover_groups"] = sum(g["state"] != "REMOVED" for g in table.values())
            results[scenario_name] = result
            for _, node in added.values():
                cluster.remove_node(node)
            deadline = time.monotonic() + 60
            while set(node_labels()) & set(added) and time.monotonic() < deadline:
                time.sleep(0.1)
        print(json.dumps(results))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
