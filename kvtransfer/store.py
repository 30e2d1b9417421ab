"""The rendezvous store of the KV transfer: a torch TCPStore that listens on one address only, and the signed view
of it (`SignedStore`) through which every worker of a deployment uses it.

torch's TCPStore server listens on the wildcard address (`::`, which takes IPv4 too) whatever host it is given:
the host only tells clients where to connect. `host_store` binds the listening socket itself and hands it over
(`master_listen_fd`), so the store is reachable on that address alone.

TCPStore has no access control: any process that reaches its port can list, read, write and delete every key.
So the workers trust no value they did not sign. The deployment's secret (`new_secret`, 128 random bits, made
by the server at start and handed to each worker in its Ray actor config, never on a command line and never
written to the store) keys an HMAC-SHA256 over each value together with its full key name. A pair's key names
hold the pair and its epoch (`_link`), so a value is bound to both: a value made up without the secret, or
copied from another key (another pair, an earlier epoch), reads as absent. What a client without the secret can
still do is delete or overwrite values, which reads as absent too; the side that wrote a value puts it back while
its peer may still need it (`SignedStore.heal`, and `_link.Pair`'s meeting loop). It can read the values: they are
signed, not encrypted (a pair's epoch, its ready flags, the process group's addresses).

Why a signed store rather than the workers' Ray calls: torch.distributed's groups (gloo's address exchange,
NCCL's unique id) rendezvous through a `dist.Store` from inside C++; a store that signs and checks every value
carries them unchanged, on CPU and GPU, and keeps this package free of Ray (its tests run two processes with no
cluster). Ray's own token auth guards the one thing that must stay secret, the key, on its way to the workers.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from .config import KVTransferConfig

_BACKLOG = 512
_MAC_HEX = 64
_ABSENT = b"\x00pdserve-absent\x00"
"""`compare_set`'s expected value in `SignedStore._raw_read`: never a signed value (those start with hex digits),
so the call reads the key without setting it and, unlike `get`, without waiting for a missing one."""
_ADD_TRIES = 64
POLL_S = 0.002
"""Between reads of a key that is not (validly) there yet."""
ABORT_CHECK_S = 0.05
"""How often a wait asks its `abort` callback whether to give up."""
HEAL_S = 0.02
"""How often `SignedStore.healing` puts back what was lost."""


def new_secret() -> str:
    """A fresh deployment secret: the key that signs every value its workers put in the store."""
    return secrets.token_hex(16)


class SignedStore(dist.Store):
    """A view of a store (`raw`, a TCPStore client) in which every value is signed with the deployment's secret
    over its key name (`prefix` + key), and a value that does not verify is absent. torch's process groups use
    it as their store (`set`, `get`, `wait`, `check`, `add`, `compare_set`, `delete_key`, `num_keys`, `clone`).

    `get` and `wait` poll (a missing key costs no blocking request, which a deleted key would stretch to the
    client's timeout), up to their timeout or until `abort()` returns True. With `keep`, the values set here are
    remembered so that `heal` can put back any that were deleted or overwritten.

    Thread-safe as far as `raw` is (a TCPStore client serves one request at a time). A torch store written in
    Python: C++ reaches it through the Python object, which must outlive every group built on it (`_link.Pair`
    keeps its groups' stores)."""

    def __init__(
        self, raw: dist.Store, secret: str, prefix: str = "", timeout_s: float = 60.0,
        keep: bool = False, abort: Callable[[], bool] | None = None,
    ):  # fmt: skip
        if not secret:
            raise ValueError(
                "SignedStore: an empty secret signs nothing; pass the deployment's secret"
            )
        super().__init__()
        self.raw, self.prefix, self.timeout_s = raw, prefix, timeout_s
        self._secret = secret
        self._mac_key = hmac.new(secret.encode(), b"pdserve kv-store v1", hashlib.sha256).digest()
        self._abort = abort
        self._kept: dict[str, bytes] | None = {} if keep else None
        self._lock = threading.Lock()

    def view(
        self, raw: dist.Store | None = None, prefix: str = "", keep: bool = False,
        abort: Callable[[], bool] | None = None, timeout_s: float | None = None,
    ) -> SignedStore:  # fmt: skip
        """Another view under the same secret: over `raw` (default: the same client), its keys under
        `prefix` (after this view's)."""
        return SignedStore(
            self.raw if raw is None else raw, self._secret, self.prefix + prefix,
            self.timeout_s if timeout_s is None else timeout_s, keep, abort,
        )  # fmt: skip

    # Signing.

    def _mac(self, name: str, payload: bytes) -> bytes:
        return (
            hmac.new(self._mac_key, name.encode() + b"\0" + payload, hashlib.sha256)
            .hexdigest()
            .encode()
        )

    def sign(self, key: str, value: bytes | str) -> bytes:
        """What `set(key, value)` writes under the raw store's key `prefix + key`."""
        payload = value.encode() if isinstance(value, str) else bytes(value)
        return self._mac(self.prefix + key, payload) + payload

    def verify(self, key: str, raw_value: bytes | None) -> bytes | None:
        """The payload of a raw value read under `prefix + key`, or None when it is missing or does not verify."""
        if raw_value is None or len(raw_value) < _MAC_HEX:
            return None
        mac, payload = raw_value[:_MAC_HEX], raw_value[_MAC_HEX:]
        return payload if hmac.compare_digest(mac, self._mac(self.prefix + key, payload)) else None

    def _raw_read(self, name: str) -> bytes | None:
        value = self.raw.compare_set(name, _ABSENT, _ABSENT)
        return None if value == _ABSENT else value

    def read(self, key: str) -> bytes | None:
        """The verified value of `key` now (None: missing, forged, or copied from another key); never waits."""
        return self.verify(key, self._raw_read(self.prefix + key))

    # The store interface.

    def set(self, key: str, value: bytes | str) -> None:
        signed = self.sign(key, value)
        if self._kept is not None:
            with self._lock:
                self._kept[self.prefix + key] = signed
        self.raw.set(self.prefix + key, signed)

    def get(self, key: str) -> bytes:
        return self._wait_for([key], self.timeout_s)[0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, self.timeout_s if timeout is None else timeout.total_seconds())

    def check(self, keys: list[str]) -> bool:
        return all(self.read(key) is not None for key in keys)

    def add(self, key: str, amount: int) -> int:
        """A signed counter: read, verify, compare-and-set (a value that does not verify counts as 0)."""
        name = self.prefix + key
        for _ in range(_ADD_TRIES):
            current = self._raw_read(name)
            payload = self.verify(key, current)
            value = (int(payload) if payload is not None else 0) + amount
            signed = self.sign(key, str(value))
            if self.raw.compare_set(name, current or b"", signed) == signed:
                return value
        # Another client keeps changing the key (or wrote `_ABSENT` itself): the last count read wins.
        self.raw.set(name, signed)
        return value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        name = self.prefix + key
        expected = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired = desired.encode() if isinstance(desired, str) else bytes(desired)
        current = self._raw_read(name)
        payload = self.verify(key, current)
        if payload is None and expected == b"" or payload == expected:
            signed = self.sign(key, desired)
            if self.raw.compare_set(name, current or b"", signed) == signed:
                return desired
            payload = self.read(key)
        return expected if payload is None else payload

    def delete_key(self, key: str) -> bool:
        if self._kept is not None:
            with self._lock:
                self._kept.pop(self.prefix + key, None)
        return self.raw.delete_key(self.prefix + key)

    def num_keys(self) -> int:
        return self.raw.num_keys()

    def clone(self) -> SignedStore:
        return self.view(raw=self.raw.clone(), keep=self._kept is not None, abort=self._abort)

    def heal(self) -> int:
        """Puts back each value `set` through this view (with `keep`; not counters or `compare_set`'s values)
        that is no longer in the store as written (deleted or overwritten); returns how many."""
        if self._kept is None:
            return 0
        with self._lock:
            kept = list(self._kept.items())
        healed = 0
        for name, signed in kept:
            if self._raw_read(name) != signed:
                self.raw.set(name, signed)
                healed += 1
        return healed

    def healing(self, interval_s: float = HEAL_S) -> Healer:
        """A `Healer` of this view (made with `keep`): running until stopped, it puts back what the view set and
        lost every `interval_s`."""
        return Healer(self, interval_s)

    def _wait_for(self, keys: list[str], timeout_s: float) -> list[bytes]:
        start = time.monotonic()
        deadline, next_check = start + timeout_s, start + ABORT_CHECK_S
        values: dict[str, bytes] = {}
        while True:
            for key in keys:
                if key not in values:
                    value = self.read(key)
                    if value is not None:
                        values[key] = value
            if len(values) == len(keys):
                return [values[key] for key in keys]
            now = time.monotonic()
            missing = [self.prefix + k for k in keys if k not in values]
            if now >= deadline:
                raise dist.DistStoreError(
                    f"no valid value of {missing} in the store within {timeout_s:g}s"
                )
            if self._abort is not None and now >= next_check:
                if self._abort():
                    raise dist.DistStoreError(
                        f"gave up waiting for {missing} in the store (the other side is gone)"
                    )
                next_check = now + ABORT_CHECK_S
            time.sleep(POLL_S)


class Healer:
    """A thread that puts back (`SignedStore.heal`) every `interval_s` what a view set and lost, from its
    making until `stop` (or the end of its `with` block), while a rendezvous through the view is under way:
    a deleted or overwritten value then costs its readers a few polls, not their timeout."""

    def __init__(self, view: SignedStore, interval_s: float = HEAL_S):
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(view, interval_s), name="pdserve-store-heal", daemon=True
        )
        self._thread.start()

    def _run(self, view: SignedStore, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with contextlib.suppress(
                Exception
            ):  # store unreachable: the rendezvous fails on its own
                view.heal()

    def stop(self) -> None:
        """Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Healer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


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


def connect_store(config: KVTransferConfig, is_master: bool, secret: str) -> SignedStore:
    """The shared store, signed with the deployment's `secret` (required: an unsigned store is open to anyone
    who reaches its port); exactly one process of the deployment hosts it (`is_master`, on store_host only), on
    a free port when `store_port` is 0; the others connect to the port it got."""
    if not secret:
        raise ValueError(
            "connect_store: no secret; every process of a deployment must pass the deployment's secret "
            "(`new_secret`, handed to workers through Ray)"
        )
    if is_master:
        store = host_store(config.store_host, config.store_port, config.connect_timeout_s)
    elif config.store_port == 0:
        raise ValueError("store_port=0: a client must be given the port the hosting process got")
    else:
        store = dist.TCPStore(
            config.store_host, config.store_port, is_master=False,
            timeout=timedelta(seconds=config.connect_timeout_s),
        )  # fmt: skip
    return SignedStore(store, secret, timeout_s=config.connect_timeout_s)
