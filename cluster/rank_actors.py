"""A worker's rank processes as Ray actors: one placement group per worker with one bundle per rank
(`placement.rank_bundles`, `placement.rank_placement`), and `RayRankLauncher`, which starts ranks 1..N-1 as
actors on bundles 1..N-1 (bundle 0 is the driver's: the worker actor itself) for `pdserve.engine.RankGroup`."""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.cluster import placement
from pdserve.cluster.errors import UnavailableError
from pdserve.engine.ranks.channel import RankLostError
from pdserve.engine.ranks.group import RankLauncher
from pdserve.engine.ranks.process import run_rank

__all__ = ["RayRankLauncher", "bundle_nodes", "make_rank_placement_group", "node_labels"]

log = logging.getLogger(__name__)


class _RankActor:
    """One rank process: `run` holds it for the rank's whole life and returns when the driver stops it."""

    def run(self, bootstrap: bytes) -> None:
        run_rank(bootstrap)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def node_labels() -> dict[str, dict[str, str]]:
    """Labels of every live node of the connected Ray cluster, by node id."""
    return {n["NodeID"]: dict(n.get("Labels", {})) for n in ray.nodes() if n["Alive"]}


def bundle_nodes(group: PlacementGroup) -> list[str]:
    """Node id of each bundle of a ready placement group, in bundle order."""
    placed = ray.util.placement_group_table(group)["bundles_to_node_id"]
    return [placed[i] for i in range(len(placed))]


def make_rank_placement_group(
    num_ranks: int, gpus_per_rank: int, cpus_per_rank: float, span: str, timeout_s: float
) -> PlacementGroup:
    """A ready placement group for a worker's ranks, or `UnavailableError` saying why the cluster can never
    hold it, or that it was not ready within `timeout_s` (the group is then removed)."""
    bundles = placement.rank_bundles(num_ranks, gpus_per_rank, cpus_per_rank)
    alive = [n for n in ray.nodes() if n["Alive"]]
    reason = placement.ranks_unplaceable_reason(
        bundles, [n["Resources"] for n in alive], [n.get("Labels", {}) for n in alive], span
    )
    if reason is not None:
        raise UnavailableError(reason)
    group = ray.util.placement_group(bundles, **placement.rank_placement(span))
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise UnavailableError(
            f"placement group of {num_ranks} rank bundles {bundles[0]} (span {span}) not ready in "
            f"{timeout_s} s: the resources are held by others"
        )
    return group


class RayRankLauncher(RankLauncher):
    """Ranks 1..N-1 as actors on bundles 1..N-1 of `group`. A rank's actor dying (or `run` returning early)
    is a lost rank. Ranks do not watch the driver's process id (it may be on another node): an actor's owner
    dying takes its actors down."""

    watches_driver_pid = False

    def device(self, rank: int, backend: str) -> str:
        # Ray gives each actor of a GPU bundle its own CUDA_VISIBLE_DEVICES; the driver's worker actor too
        return "cuda:0" if backend == "nccl" else "cpu"

    def __init__(self, group: PlacementGroup, gpus_per_rank: int, cpus_per_rank: float):
        self.group, self.gpus_per_rank, self.cpus_per_rank = group, gpus_per_rank, cpus_per_rank
        self.actors: list = []
        self.runs: list[ray.ObjectRef] = []
        self._node_refs: list[ray.ObjectRef] = []

    def launch(self, bootstraps: list[bytes]) -> None:
        actor_class = ray.remote(_RankActor)
        for bundle, boot in enumerate(bootstraps, start=1):
            actor = actor_class.options(
                num_cpus=self.cpus_per_rank, num_gpus=self.gpus_per_rank, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, bundle),
            ).remote()  # fmt: skip
            self.actors.append(actor)
            # asked before `run`, which holds the actor for the rank's whole life
            self._node_refs.append(actor.node_id.remote())
            self.runs.append(actor.run.remote(boot))

    def rank_nodes(self, timeout_s: float) -> list[str]:
        """Node id of each launched rank, 1..N-1."""
        return ray.get(self._node_refs, timeout=timeout_s)

    def check(self) -> None:
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        if not done:
            return
        lost, why = [], []
        for rank, ref in enumerate(self.runs, start=1):
            if ref in done:
                lost.append(rank)
                try:
                    ray.get(ref, timeout=0)
                    why.append(f"rank {rank} returned")
                except Exception as e:  # a dead actor's error, reported by name
                    why.append(f"rank {rank}: {type(e).__name__}")
        raise RankLostError(lost, "; ".join(why))

    def stop(self, timeout_s: float) -> None:
        if self.runs and timeout_s > 0:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.runs = [], []
