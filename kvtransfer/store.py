"""The rendezvous store of the KV transfer: a torch TCPStore that listens on one address only, and the view of
it that every worker of a deployment shares, all keys under the deployment's secret prefix.

torch's TCPStore server listens on the wildcard address (`::`, which takes IPv4 too) whatever host it is given:
the host only tells clients where to connect. `host_store` binds the listening socket itself and hands it over
(`master_listen_fd`), so the store is reachable on that address alone.

The secret prefix (`new_secret`, 128 random bits, handed to workers through Ray, never on a command line) keeps
a client that knows the store's address and pdserve's key names from reading or moving a pair's keys (its epoch,
its ready flags, its process group's rendezvous). It is not access control: TCPStore has none, and its
`list_keys` request shows every key, prefix included, to anyone who can connect. The store's address is the
boundary: loopback on one node, the node's own address on several, behind the cluster's network."""

from __future__ import annotations

import secrets
import socket
from datetime import timedelta

import torch.distributed as dist

from .config import KVTransferConfig

_BACKLOG = 512


def new_secret() -> str:
    """A fresh deployment secret: the prefix of every key its workers use."""
    return secrets.token_hex(16)


def host_store(
    host: str, port: int, timeout_s: float, world_size: int | None = None
) -> dist.TCPStore:
    """A TCPStore server listening on host:port only (port 0: a free one; `.port` tells which). Raises OSError
    when host:port cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    # The store's server owns the socket from here (it closes it when it stops).
    return dist.TCPStore(
        host, port, world_size, True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=sock.detach(),
    )  # fmt: skip


def connect_store(config: KVTransferConfig, is_master: bool, secret: str = "") -> dist.Store:
    """The shared store under `secret`'s prefix; exactly one process of the deployment hosts it (`is_master`,
    on store_host only), on a free port when `store_port` is 0; the others connect to the port it got."""
    if is_master:
        store = host_store(config.store_host, config.store_port, config.connect_timeout_s)
    elif config.store_port == 0:
        raise ValueError("store_port=0: a client must be given the port the hosting process got")
    else:
        store = dist.TCPStore(
            config.store_host, config.store_port, is_master=False,
            timeout=timedelta(seconds=config.connect_timeout_s),
        )  # fmt: skip
    return dist.PrefixStore(secret, store) if secret else store
