"""The paged latent KV cache: per layer a page pool [num_pages, page_size, kv_lora_rank + qk_rope_head_dim].

A page holds `page_size` consecutive positions of one request in every layer; a request's page table lists its
pages in position order. MLA caches one row per token per layer, [c_kv | k_pe], shared by all heads, so any
attention-TP layout of a prefill worker can feed any layout of a decode worker. The pools of all layers live in one
tensor [num_layers, num_pages, page_size, dim], `data`; the KV transfer (pdserve.kvtransfer) moves whole pages
(all layers) in and out of it.
"""

from __future__ import annotations

import dataclasses

import torch

from .args import ModelArgs


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheLayout:
    num_layers: int
    """Cached layers: the main layers, then one per MTP module."""
    page_size: int
    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size={self.page_size}: must be positive")

    @classmethod
    def for_model(
        cls, args: ModelArgs, page_size: int, dtype: torch.dtype, num_mtp: int = 0
    ) -> KVCacheLayout:
        return cls(
            args.num_hidden_layers + num_mtp, page_size, args.kv_lora_rank,
            args.qk_rope_head_dim, dtype,
        )  # fmt: skip

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.page_size * self.entry_dim * itemsize


class PagedKVCache:
    """Owns the cache memory of one worker. Page ids are handed out by a `PageAllocator`, not here."""

    def __init__(self, layout: KVCacheLayout, num_pages: int, device: torch.device | str):
        self.layout, self.num_pages = layout, num_pages
        shape = (layout.num_layers, num_pages, layout.page_size, layout.entry_dim)
        self.data = torch.zeros(shape, dtype=layout.dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def layer(self, layer: int) -> torch.Tensor:
        """[num_pages, page_size, entry_dim] view of one layer's pool."""
        return self.data[layer]

    def write(
        self, layer: int, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
    ) -> None:
        """Stores [c_kv | k_pe] of T tokens at flat slots (page * page_size + offset). slots: [T] int64."""
        flat = self.data[layer].view(-1, self.layout.entry_dim)
        r = self.layout.kv_lora_rank
        flat[slots, :r] = c_kv.to(self.layout.dtype)
        flat[slots, r:] = k_pe.to(self.layout.dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Rows at flat slots of one layer: [N, entry_dim]."""
        return self.data[layer].view(-1, self.layout.entry_dim).index_select(0, slots)


def capacity_pages(
    layout: KVCacheLayout,
    device: torch.device | str,
    num_pages: int | None,
    gpu_memory_fraction: float,
    cpu_cache_bytes: int,
) -> int:
    """How many pages a worker's cache gets: `num_pages` when set; on a GPU, the given fraction of the memory
    free now (after the weights are loaded); on the CPU, `cpu_cache_bytes`."""
    if num_pages is not None:
        return num_pages
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_memory_fraction)
    else:
        budget = cpu_cache_bytes
    pages = budget // layout.page_bytes
    if pages < 1:
        raise ValueError(f"no room for one KV page of {layout.page_bytes} bytes on {device}")
    return pages
