"""`Worker`: what a prefill and a decode worker share. A model runner over the worker's paged KV cache, its page
allocator, the lock that control calls (any thread) and the loop thread take, and the loop: step while there is
work, otherwise wait for a wake-up or `idle_wait_s`. A role subclasses it with its scheduler and its `step`."""

from __future__ import annotations

import threading

from pdserve.model.deepseek import Transformer
from pdserve.model.pages import PageAllocator
from pdserve.model.runner import ModelRunner


class Worker:
    idle_wait_s = 0.05
    """Longest the loop sleeps with nothing to do when nothing wakes it."""

    def __init__(
        self, worker_id: str, model: Transformer, config, kv_cache_dtype: str = "auto",
        cuda_graphs: bool = True,
    ):  # fmt: skip
        """config: the role's config (page_size, num_pages, gpu_memory_fraction, cpu_cache_bytes);
        kv_cache_dtype: auto or fp8 (`pdserve.model.kv_cache`), the same on both sides of a transfer."""
        self.worker_id, self.model, self.config = worker_id, model, config
        self.runner = ModelRunner.sized(
            model,
            config.page_size,
            config.num_pages,
            config.gpu_memory_fraction,
            config.cpu_cache_bytes,
            cuda_graphs=cuda_graphs,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.allocator = PageAllocator(self.runner.num_pages)
        self._lock = threading.Lock()
        self._wake = threading.Event()

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def step(self) -> bool:
        """Runs one step of the role's work; False when there was nothing to do."""
        raise NotImplementedError

    def run(self, stop: threading.Event) -> None:
        """The worker's loop: steps while there is work, waits for a wake-up otherwise, until `stop`."""
        while not stop.is_set():
            if not self.step():
                self._wake.wait(timeout=self.idle_wait_s)
                self._wake.clear()
