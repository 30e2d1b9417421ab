"""Workers in their own OS processes for tests: each process loads the model, builds its worker with the
torch.distributed KV transfer, runs the worker's loop thread, and answers method calls sent over a local pipe
(the test's control plane; the KV pages travel through torch.distributed)."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from pdserve.engine.ranks.group import rank_process_context
from pdserve.kvtransfer.store import new_secret

_CTX = rank_process_context()  # forked from a server that imported torch once
SECRET = new_secret()
"""The KV store's key for the workers these tests start (passed to each child, which would draw its own)."""


def _serve(
    conn, role: str, worker_id: str, model_dir: str, config, kv_config, store_master: bool,
    device: str, dtype: str, kv_cache_dtype: str, store_secret: str,
):  # fmt: skip
    import torch

    from pdserve.decode import DecodeWorker
    from pdserve.kvtransfer.dist import DistKVReceiver, DistKVSender, connect_store
    from pdserve.model.loader import load_model
    from pdserve.prefill import PrefillWorker

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dev = torch.device(device)
    model = load_model(model_dir, device, getattr(torch, dtype), progress=False)
    store = connect_store(kv_config, is_master=store_master, secret=store_secret)
    if role == "prefill":
        worker = PrefillWorker(
            worker_id, model, config, DistKVSender(kv_config, store, worker_id, dev),
            kv_cache_dtype,
        )  # fmt: skip
    else:
        worker = DecodeWorker(
            worker_id, model, config,
            lambda cache: DistKVReceiver(kv_config, store, worker_id, cache), kv_cache_dtype,
        )  # fmt: skip
    stop = threading.Event()
    threading.Thread(target=worker.run, args=(stop,), daemon=True).start()
    conn.send(("ok", None))
    while True:
        method, args = conn.recv()
        if method == "exit":
            stop.set()
            worker.close()
            conn.send(("ok", None))
            return
        try:
            if method == "set_send_delay":  # fault injection: stall between header and pages
                worker.sender.delay_after_header_s = args[0]
                result = None
            else:
                result = getattr(worker, method)(*args)
            conn.send(("ok", result))
        except Exception as e:  # noqa: BLE001 (returned to the caller)
            conn.send(("err", e))


class WorkerProcess:
    """A worker in a child process; attribute calls are forwarded and block for the answer."""

    def __init__(
        self, role, worker_id, model_dir, config, kv_config, store_master=False, device="cpu",
        dtype="float32", kv_cache_dtype="auto", store_secret=SECRET,
    ):  # fmt: skip
        self.worker_id = worker_id
        self._conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(
            target=_serve,
            args=(
                child,
                role,
                worker_id,
                str(model_dir),
                config,
                kv_config,
                store_master,
                device,
                dtype,
                kv_cache_dtype,
                store_secret,
            ),
            daemon=True,
        )
        self.proc.start()
        self._lock = threading.Lock()
        self._call("__ready__", ())

    def _call(self, method: str, args: tuple) -> Any:
        with self._lock:
            if method != "__ready__":
                self._conn.send((method, args))
            if not self._conn.poll(600 if method == "__ready__" else 120):
                raise TimeoutError(f"{self.worker_id}.{method} did not answer")
            status, value = self._conn.recv()
        if status == "err":
            raise value
        return value

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args: self._call(name, args)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(EOFError, OSError, TimeoutError):
                self._call("exit", ())
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
