"""Ray actor shells around `PrefillWorker` and `DecodeWorker`: plain classes here (`pools` applies `ray.remote`).

A shell loads the model on its device (cuda:0 inside the actor when it has GPUs, else the CPU), joins the shared KV
store the router hosts, builds its worker and runs the worker's loop in a thread. It is a threaded actor: control
calls (submit, abort, stats) and the router's long-poll for outputs run on other threads while the loop steps.
Every payload in or out is msgpack bytes (`pdserve.engine.messages`). The actor is a process boundary: unexpected
exceptions are logged with their traceback and returned as a `WorkerError`; if the worker's loop itself dies,
the process exits so that Ray reports the worker dead and the router moves its requests to other workers.

A worker of several ranks (`ranks` > 1 in its role config) runs in a placement group of one bundle per rank: the
shell is rank 0 on bundle 0 and starts ranks 1..N-1 as Ray actors on the other bundles (`RayRankLauncher`),
all joined by one torch.distributed group (NCCL on GPUs, gloo on CPU); each rank loads only its shard. A
prefill worker sends from rank 0 (its ranks are tensor-parallel: the same latent cache on each); each
data-parallel rank of a decode worker receives its own requests' KV pages (`pdserve.engine.ranks.kv`). Before
`ready` answers, the worker runs its warm-up (every prompt size and decode graph bucket it will run). When a rank
is lost the worker fails its requests (the router moves them) and its loop dies, which ends the shell's process
as above (its rank actors go with it: Ray ends the actors an actor owns)."""

from __future__ import annotations

import logging
import os
import threading

from pdserve.cluster.config import ModelConfig
from pdserve.engine import messages
from pdserve.engine.messages import DecodeRequest, PrefillRequest
from pdserve.kvtransfer import KVTransferConfig

logger = logging.getLogger(__name__)


def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(name)


class _WorkerShell:
    role = ""

    def __init__(
        self, worker_id: str, model: ModelConfig, worker_config, kv_config: KVTransferConfig,
        num_gpus: int, cpu_threads: int, cpus_per_rank: float = 1.0, store_secret: str = "",
    ):  # fmt: skip
        """num_gpus: of this process (rank 0 of a worker of several ranks: 0 or 1, as each other rank);
        cpus_per_rank: what each other rank's actor reserves; store_secret: the key that signs the KV store's values."""
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        self.worker_id = worker_id
        self.worker = None
        self._init_error: BaseException | None = None
        self._stop = threading.Event()
        self._kernel_choice = (model.kernels, model.batch_invariant)
        self.ranks = None
        self._cpus_per_rank = cpus_per_rank
        self._store_secret = store_secret
        try:
            with self._kernels():
                self._start(model, worker_config, kv_config, num_gpus, cpu_threads)
        except Exception as e:  # process boundary: reported by ready()
            logger.error("%s failed to start", worker_id, exc_info=True)
            self._init_error = e

    def _kernels(self):
        """The kernel library's context for this worker's configuration. Entered by every thread that runs
        kernels (model load, graph capture, the loop): a context variable does not cross threads."""
        from pdserve import kernels

        return kernels.use(*self._kernel_choice)

    def _start(self, model, worker_config, kv_config, num_gpus: int, cpu_threads: int) -> None:
        import torch

        from pdserve.kvtransfer.dist import connect_store
        from pdserve.model.loader import load_model
        from pdserve.model.random_checkpoint import resolve_model

        if num_gpus > 0:
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
        else:
            torch.set_num_threads(cpu_threads)
            self.device = torch.device("cpu")
        path = resolve_model(model.path)  # `tiny` is made on this node if its cache lacks it
        if worker_config.layout.ranks > 1:
            self.model = None  # rank 0's shard is loaded by its rank handler
            self.ranks = self._start_ranks(str(path), model, worker_config, num_gpus, kv_config)
        else:
            self.model = load_model(
                path, self.device, _torch_dtype(model.dtype), progress=False,
                load_format=model.load_format,
            )  # fmt: skip
        self.store = connect_store(kv_config, is_master=False, secret=self._store_secret)
        self.kv_cache_dtype = model.kv_cache_dtype
        self.worker = self._build(worker_config, kv_config)
        self.worker.warm_up()  # every kernel compiled, every decode graph captured, before it serves
        self._loop = threading.Thread(target=self._run, name=f"{self.worker_id}-loop", daemon=True)
        self._loop.start()

    def _start_ranks(
        self, path: str, model: ModelConfig, worker_config, num_gpus: int,
        kv_config: KVTransferConfig,
    ):  # fmt: skip
        """Starts ranks 1..N-1 on the other bundles of this actor's placement group and joins them; a decode
        worker's ranks each receive their own requests' KV pages."""
        import dataclasses

        import ray

        from pdserve.cluster.placement import rank_channel
        from pdserve.cluster.rank_actors import RayRankLauncher, bundle_nodes
        from pdserve.engine.ranks.runner import start_rank_group

        group = ray.util.get_current_placement_group()
        if group is None:
            raise RuntimeError(
                f"{self.worker_id}: a worker of several ranks needs a placement group"
            )
        launcher = RayRankLauncher(group, int(num_gpus > 0), self._cpus_per_rank)
        kv = {
            "config": dataclasses.asdict(kv_config), "worker_id": self.worker_id,
            "store_secret": self._store_secret,
        }  # fmt: skip
        # ranks over several nodes (an NVLink domain's trays) plan over gloo and reach this node's store
        channel = rank_channel(bundle_nodes(group))
        store_host = ray.util.get_node_ip_address() if channel == "dist" else "127.0.0.1"
        return start_rank_group(
            worker_config, path, model.dtype, model.kv_cache_dtype, launcher,
            backend="nccl" if num_gpus > 0 else "gloo", load_format=model.load_format,
            kernel_choice=self._kernel_choice,
            kv=kv if self.role == "decode" else None, channel=channel, store_host=store_host,
        )  # fmt: skip

    def _build(self, worker_config, kv_config):
        raise NotImplementedError

    def _run(self) -> None:
        try:
            with self._kernels():
                self.worker.run(self._stop)
        except BaseException:  # process boundary: the worker is unusable; let Ray report it dead
            logger.critical("%s: worker loop died", self.worker_id, exc_info=True)
            os._exit(1)

    def _call(self, fn) -> bytes:
        try:
            return messages.reply(fn)
        except Exception as e:  # process boundary: returned to the router as a WorkerError
            logger.error("%s: call failed", self.worker_id, exc_info=True)
            return messages.reply_error(e)

    def ready(self) -> bytes:
        """What the router needs to know once the model is loaded: node, device and KV capacity."""
        import ray

        from pdserve.engine import worker

        if self._init_error is not None:
            return messages.reply_error(self._init_error)
        return self._call(lambda: {
            "node_ip": ray.util.get_node_ip_address(),
            "device": str(self.device),
            "num_pages": self.worker.num_pages,
            "page_size": self.worker.config.page_size,
            "prefix_cache": worker.prefix_cache_info(self.worker.scheduler),
            "pid": os.getpid(),
            "rank_pids": [] if self.ranks is None else list(self.ranks.rank_pids),
        })  # fmt: skip

    def stats(self) -> bytes:
        return self._call(self.worker.stats)

    def abort(self, request_id: str) -> bytes:
        return self._call(lambda: self.worker.abort(request_id))

    def close(self) -> None:
        self._stop.set()
        if self.worker is not None:
            self._loop.join(timeout=10)
            self.worker.close()


class PrefillShell(_WorkerShell):
    role = "prefill"

    def _build(self, worker_config, kv_config):
        from pdserve.kvtransfer.dist import DistKVSender
        from pdserve.prefill import PrefillWorker

        sender = DistKVSender(kv_config, self.store, self.worker_id, self.device)
        return PrefillWorker(
            self.worker_id, self.model, worker_config, sender, self.kv_cache_dtype, self.ranks
        )

    def submit(self, request: bytes) -> bytes:
        return self._call(lambda: self.worker.submit(messages.decode(PrefillRequest, request)))

    def peer_lost(self, decode_worker: str) -> bytes:
        return self._call(lambda: self.worker.peer_lost(decode_worker))

    def poll_failures(self, timeout_s: float) -> bytes:
        """The requests the worker failed since the last call and its prefix cache's events (`PrefillPoll`);
        waits up to timeout_s for them (the router's long-poll: `PrefillWorker.poll`)."""
        return messages.encode(self.worker.poll(timeout_s))


class DecodeShell(_WorkerShell):
    role = "decode"

    def _build(self, worker_config, kv_config):
        from pdserve.decode import DecodeWorker
        from pdserve.kvtransfer.dist import DistKVReceiver

        def make_receiver(cache):
            return DistKVReceiver(kv_config, self.store, self.worker_id, cache)

        return DecodeWorker(
            self.worker_id, self.model, worker_config,
            make_receiver if self.ranks is None else None, self.kv_cache_dtype, self.ranks,
        )  # fmt: skip

    def add_request(self, request: bytes) -> bytes:
        return self._call(lambda: self.worker.add_request(messages.decode(DecodeRequest, request)))

    def poll_outputs(self, timeout_s: float) -> bytes:
        """Per-step output batches since the last call, with the prefix cache's events (`DecodePoll`); waits up
        to timeout_s for the first batch."""
        return messages.encode(self.worker.poll(timeout_s))
