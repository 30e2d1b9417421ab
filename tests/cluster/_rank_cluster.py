"""Run by test_rank_placement as its own process: a Ray cluster of three simulated nodes (a1, a2 in NVLink domain
'a' with 2 fake GPUs each, b1 in domain 'b' with 3), one worker's rank group placed on it per span, the driver
being this process. Prints one JSON line: each node's name by id, and per span where the ranks landed and what
they replied; then the reason a 5-rank domain worker is refused. Also the handler the rank actors run (this
folder is on their PYTHONPATH)."""

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

    from pdserve.cluster.rank_actors import RayRankLauncher, make_rank_placement_group
    from pdserve.engine.rank_group import RankGroup, RankGroupConfig
    from pdserve.engine.rank_process import HandlerSpec

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
        return {"rank_nodes": [driver_node, *actor_nodes], "replies": [r["rank"] for r in replies]}
    finally:
        ray.util.remove_placement_group(group)


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from pdserve.cluster.errors import UnavailableError
    from pdserve.cluster.placement import NVLINK_DOMAIN_LABEL
    from pdserve.cluster.rank_actors import make_rank_placement_group, node_labels

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    try:
        names = {}
        for name, gpus in (("a1", 2), ("a2", 2), ("b1", 3)):
            node = cluster.add_node(
                num_cpus=2, num_gpus=gpus, labels={NVLINK_DOMAIN_LABEL: name[0]}
            )
            names[node.node_id] = name
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        cluster.wait_for_nodes()
        result = {"nodes": names}
        result["labels"] = node_labels()
        result["node"] = run_worker("node", 3, "shm")
        result["nvlink_domain"] = run_worker("nvlink_domain", 4, "dist")
        try:
            make_rank_placement_group(5, 1, 0.5, "nvlink_domain", timeout_s=10)
            result["too_big"] = "placed"
        except UnavailableError as e:
            result["too_big"] = str(e)
        table = ray.util.placement_group_table()
        result["leftover_groups"] = sum(g["state"] != "REMOVED" for g in table.values())
        print(json.dumps(result))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
