"""Where workers go, as pure functions over resource tables: one placement group per worker, a single bundle
holding all its GPUs and CPUs, STRICT_PACK (a worker's GPUs share a node). A worker of N rank processes has one
bundle per rank instead (`rank_bundles`), kept on one node (STRICT_PACK) or, on a GB200 NVL72 rack, within the
nodes of one NVLink domain (`rank_placement`), the domain named by each node's `NVLINK_DOMAIN_LABEL`; ranks
that landed on several nodes plan their steps over the network (`rank_channel`)."""

from __future__ import annotations

from collections.abc import Mapping

STRATEGY = "STRICT_PACK"
NVLINK_DOMAIN_LABEL = "pdserve.nvlink_domain"
"""Node label naming the NVLink domain a node's GPUs belong to (`ray start --labels`)."""
NODE_ID_LABEL = "ray.io/node-id"
RANK_SPANS = ("node", "nvlink_domain")


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


def rank_bundles(
    num_ranks: int, gpus_per_rank: int, cpus_per_rank: float
) -> list[dict[str, float]]:
    """One bundle per rank of a worker (rank i is scheduled on bundle i): one GPU each, or none on CPU."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1")
    if gpus_per_rank not in (0, 1):
        raise ValueError(f"gpus_per_rank={gpus_per_rank}: a rank process drives 0 or 1 GPU")
    if cpus_per_rank <= 0:
        raise ValueError(f"cpus_per_rank={cpus_per_rank} must be > 0")
    bundle: dict[str, float] = {"CPU": float(cpus_per_rank)}
    if gpus_per_rank:
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(num_ranks)]


def rank_placement(span: str) -> dict[str, object]:
    """Keyword arguments of `ray.util.placement_group` for a worker's rank bundles: span 'node' keeps them on
    one node (STRICT_PACK); 'nvlink_domain' packs them on as few nodes as possible, all carrying the same
    `NVLINK_DOMAIN_LABEL` value (Ray's topology strategy: STRICT_PACK over the label, PACK over nodes)."""
    if span == "node":
        return {"strategy": STRATEGY}
    if span == "nvlink_domain":
        return {"topology_strategy": {NODE_ID_LABEL: "PACK", NVLINK_DOMAIN_LABEL: "STRICT_PACK"}}
    raise ValueError(f"rank span {span!r}, expected one of {RANK_SPANS}")


def rank_channel(bundle_nodes: list[str]) -> str:
    """Plan channel of a worker's rank group whose bundle i landed on node `bundle_nodes[i]`: 'shm' (shared
    memory) when every bundle is on one node, else 'dist' (a gloo group, which crosses nodes)."""
    if not bundle_nodes:
        raise ValueError("a rank group has at least one bundle")
    return "shm" if len(set(bundle_nodes)) == 1 else "dist"


def _bundles_held(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    return int(min(node.get(k, 0.0) // v for k, v in bundle.items() if v > 0))


def ranks_unplaceable_reason(
    bundles: list[dict[str, float]],
    node_totals: list[Mapping[str, float]],
    node_labels: list[Mapping[str, str]],
    span: str,
) -> str | None:
    """Why no node (span 'node') or no NVLink domain (span 'nvlink_domain') of the cluster could ever hold a
    worker's identical rank bundles; None when one could, given time. Nodes without the domain label belong to
    no domain."""
    if span not in RANK_SPANS:
        raise ValueError(f"rank span {span!r}, expected one of {RANK_SPANS}")
    bundle, wanted = bundles[0], len(bundles)
    if span == "node":
        best = max((_bundles_held(n, bundle) for n in node_totals), default=0)
        if best >= wanted:
            return None
        return (
            f"no node of the Ray cluster holds {wanted} bundles of {bundle} (the best holds {best})"
        )
    held: dict[str, int] = {}
    for totals, labels in zip(node_totals, node_labels, strict=True):
        domain = labels.get(NVLINK_DOMAIN_LABEL)
        if domain is not None:
            held[domain] = held.get(domain, 0) + _bundles_held(totals, bundle)
    if any(n >= wanted for n in held.values()):
        return None
    if not held:
        return f"no node of the Ray cluster carries the label {NVLINK_DOMAIN_LABEL}"
    return (
        f"no NVLink domain ({NVLINK_DOMAIN_LABEL}) of the Ray cluster holds {wanted} bundles of "
        f"{bundle} (per domain: {dict(sorted(held.items()))})"
    )


def placement_violation(
    rank_nodes: list[str], node_labels: Mapping[str, Mapping[str, str]], span: str
) -> str | None:
    """What is wrong with where a worker's ranks landed (`rank_nodes[i]`: rank i's node id) for `span`, or
    None when it obeys it."""
    if span == "node":
        nodes = sorted(set(rank_nodes))
        return None if len(nodes) == 1 else f"ranks span nodes {nodes}"
    domains = [node_labels.get(n, {}).get(NVLINK_DOMAIN_LABEL) for n in rank_nodes]
    if None in domains:
        return f"rank {domains.index(None)} is on a node with no {NVLINK_DOMAIN_LABEL} label"
    return None if len(set(domains)) == 1 else f"ranks span NVLink domains {sorted(set(domains))}"
