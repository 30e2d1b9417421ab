"""Joining Ray, or starting the local Ray that `pdserve serve` runs on by itself, on loopback with Ray's token
authentication; and what counts as loopback. Ray is imported inside the functions: a client command that only
asks `is_loopback` does not pay for it."""

from __future__ import annotations

import ipaddress
import logging
import math
import os

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.reaper import tie_ray_to_this_process

logger = logging.getLogger(__name__)

RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost: what it resolves to is not ours to trust
        return False


def ray_auth() -> str:
    """What a caller of this process's Ray must present, in words (`pdserve status`)."""
    mode = os.environ.get(RAY_AUTH_MODE_ENV, "")
    return "Ray token" if mode == "token" else f"none ({RAY_AUTH_MODE_ENV}={mode or 'unset'})"


def connect_ray(config: ServeConfig) -> None:
    """Joins the configured Ray cluster (None: RAY_ADDRESS if set, else a new local Ray). A local Ray gets
    logical CPUs for twice the configured pools, so that they can be scaled up even on a machine with fewer
    cores, runs on loopback (`_loopback_ray`: its node address, so every port it opens, is 127.0.0.1), and ends
    with this process, however it ends (`reaper`); no-op when already connected."""
    import ray

    if ray.is_initialized():
        return
    address = config.cluster.ray_address or os.environ.get("RAY_ADDRESS") or "local"
    num_cpus = None
    if address == "local":
        cluster = config.cluster
        ranks = (
            cluster.num_prefill * config.prefill.layout.ranks
            + cluster.num_decode * config.decode.layout.ranks
        )
        demand = (
            ranks * cluster.cpus_per_worker
        )  # a worker of several ranks takes a bundle per rank
        num_cpus = max(os.cpu_count() or 1, math.ceil(2 * demand))
        tie_ray_to_this_process()
        # Ray's token authentication keeps its ports to this process and its workers. Ray turns it on for a
        # new local cluster by itself; the variable is read when ray is imported, so setting it here would
        # only give the cluster a mode this process's client lacks (its start then fails on a missing token).
        # Warn where the environment turns it off.
        mode = os.environ.get(RAY_AUTH_MODE_ENV, "token")
        if mode != "token":
            logger.warning(
                "Ray token authentication is off (%s=%s): whoever reaches Ray's ports can run code here",
                RAY_AUTH_MODE_ENV, mode,
            )  # fmt: skip
        _loopback_ray()
    ray.init(
        address=address, num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING
    )
    if address == "local" and not is_loopback(ray.util.get_node_ip_address()):
        logger.warning(
            "the local Ray runs on %s, not loopback: its ports are open to that network (behind its "
            "token authentication; its autoscaler's metrics port has none)",
            ray.util.get_node_ip_address(),
        )


def _loopback_ray() -> None:
    """Makes the Ray that ray.init starts next take loopback as its node address. Ray binds its servers (GCS,
    raylet, workers, agents) and its autoscaler's Prometheus port (which has no authentication) to loopback
    when the node address is loopback, and to every interface otherwise. Ray turns a loopback address given to
    ray.init into the machine's routable one unless it runs as a one-machine Ray, whose switch is
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when ray is imported: this sets what it sets (and the variable,
    for the processes Ray starts)."""
    from ray._private import ray_constants

    os.environ[_RAY_CLUSTER_ENV] = "0"
    if hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        ray_constants.ENABLE_RAY_CLUSTER = False
