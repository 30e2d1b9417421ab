"""Where workers go, as pure functions over resource tables: one placement group per worker, a single bundle
holding all its GPUs and CPUs, STRICT_PACK (a worker's GPUs share a node)."""

from __future__ import annotations

from collections.abc import Mapping

STRATEGY = "STRICT_PACK"


def resolve_gpus_per_worker(configured: int | None, cluster_resources: Mapping[str, float]) -> int:
    """The configured count, or (None) 1 when the cluster has GPUs and 0 when it has none."""
    if configured is not None:
        return configured
    return 1 if cluster_resources.get("GPU", 0) >= 1 else 0


def worker_bundles(num_gpus: int, num_cpus: float) -> list[dict[str, float]]:
    """The placement group of one worker: one bundle, so that all of its GPUs are on one node."""
    bundle: dict[str, float] = {"CPU": num_cpus}
    if num_gpus:
        bundle["GPU"] = float(num_gpus)
    return [bundle]


def cpu_threads(num_cpus: float) -> int:
    """torch threads of a CPU worker: its reserved CPUs, at least one."""
    return max(1, int(num_cpus))


def fits_now(bundles: list[dict[str, float]], available: Mapping[str, float]) -> bool:
    """Whether the cluster has the resources free now (summed over nodes: a hint for logs, not a promise)."""
    return all(available.get(k, 0.0) >= sum(b.get(k, 0.0) for b in bundles) for k in bundles[0])


def unplaceable_reason(
    bundles: list[dict[str, float]], node_totals: list[Mapping[str, float]]
) -> str | None:
    """Why no node of the cluster could ever host these bundles (None when one could, given time)."""
    for node in node_totals:
        need: dict[str, float] = {}
        for bundle in bundles:
            for name, amount in bundle.items():
                need[name] = need.get(name, 0.0) + amount
        if all(node.get(name, 0.0) >= amount for name, amount in need.items()):
            return None
    largest = max(node_totals, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
    have = {k: largest.get(k, 0) for k in ("CPU", "GPU")}
    return f"no node of the Ray cluster has {bundles[0]} (the largest has {have})"
