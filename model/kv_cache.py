"""The paged latent KV cache: one pool of pages, each holding `page_size` consecutive positions of one request in
every layer, as rows [c_kv | k_pe] of kv_lora_rank + qk_rope_head_dim; a request's page table lists its pages in
position order. MLA caches one row per token per layer, shared by all heads, so any attention-TP layout of a
prefill worker can feed any layout of a decode worker.

The pool is page-major: `data` is [num_pages, num_layers, page_size, dim], so a page is one contiguous block
across all layers, and a run of consecutive pages is one contiguous block too. The KV transfer
(pdserve.kvtransfer) sends such a run as one message, straight from P's cache into D's, with no copy on either
side (the layout of TensorRT-LLM's block pool). A layer's view, `layer(i)`, is [num_pages, page_size, dim] with
pages num_layers * page_size rows apart; the attention kernels take the page stride.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import kernels
from ..kernels.mla_decode import dequantize_kv_fp8, fp8_format
from .args import ModelArgs
from .errors import ConfigError

KV_CACHE_DTYPES = ("auto", "fp8")
"""`kv_cache_dtype` choices: auto (the activation dtype) or fp8 (e4m3 latent rows, see the module doc)."""
FP8 = torch.float8_e4m3fn
"""A layout's dtype for the fp8 row format (stored as uint8 rows)."""


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The layout dtype for a `kv_cache_dtype` choice."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype={kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return FP8 if kv_cache_dtype == "fp8" else model_dtype


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheLayout:
    num_layers: int
    """Cached layers: the main layers, then one per MTP module."""
    page_size: int
    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype
    """The rows' dtype, or `FP8` for the fp8 row format."""

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size={self.page_size}: must be positive")
        if self.is_fp8:
            for name, d in (("kv_lora_rank", self.kv_lora_rank), ("rope dims", self.rope_dim)):
                if d < 16 or d & (d - 1):
                    raise ConfigError(
                        f"an fp8 KV cache needs {name} a power of two >= 16, the model has {d}"
                    )

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's dtype: uint8 for fp8 rows."""
        return torch.uint8 if self.is_fp8 else self.dtype

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
        """A row's width in `storage_dtype` elements (bytes for fp8 rows)."""
        if self.is_fp8:
            return fp8_format.row_bytes(self.kv_lora_rank, self.rope_dim)
        return self.kv_lora_rank + self.rope_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers."""
        itemsize = torch.empty((), dtype=self.storage_dtype).element_size()
        return self.num_layers * self.page_size * self.entry_dim * itemsize


class PagedKVCache:
    """Owns the cache memory of one worker. Page ids are handed out by a `PageAllocator`, not here.

    Slots, as in `ForwardBatch.slot_mapping`, number positions page by page: page * page_size + offset."""

    def __init__(self, layout: KVCacheLayout, num_pages: int, device: torch.device | str):
        self.layout, self.num_pages = layout, num_pages
        shape = (num_pages, layout.num_layers, layout.page_size, layout.entry_dim)
        self.data = torch.zeros(shape, dtype=layout.storage_dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def layer(self, layer: int) -> torch.Tensor:
        """[num_pages, page_size, entry_dim] view of one layer's rows (pages num_layers * page_size rows
        apart)."""
        return self.data[:, layer]

    def _rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache as rows [*, dim] starting at page 0 of `layer`, and the rows of `slots` in it."""
        page_size, num_layers = self.layout.page_size, self.layout.num_layers
        flat = self.data.view(-1, self.layout.entry_dim)[layer * page_size :]
        rows = torch.add(
            slots,
            torch.div(slots, page_size, rounding_mode="floor"),
            alpha=(num_layers - 1) * page_size,
        )  # page * num_layers * page_size + offset
        return flat, rows

    def write(
        self, layer: int, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
    ) -> None:
        """Stores [c_kv | k_pe] of T tokens at `slots` of one layer (quantized for fp8 rows), in one launch
        on a GPU. slots: [T] int64; c_kv [T, kv_lora_rank] and k_pe [T, rope] may be strided views."""
        write = kernels.write_kv_fp8 if self.layout.is_fp8 else kernels.write_kv
        write(self.layer(layer), slots, c_kv, k_pe)

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Rows [c_kv | k_pe] at `slots` of one layer: [N, kv_lora_rank + rope], in the cache's dtype
        (fp32, dequantized, for fp8 rows)."""
        flat, rows = self._rows(layer, slots)
        picked = flat.index_select(0, rows)
        if self.layout.is_fp8:
            return dequantize_kv_fp8(picked, self.layout.kv_lora_rank, self.layout.rope_dim)
        return picked


def capacity_pages(
    layout: KVCacheLayout,
    device: torch.device | str,
    num_pages: int | None,
    gpu_memory_fraction: float,
    cpu_cache_bytes: int,
    reserve_bytes: int = 0,
    utilization: float = 1.0,
) -> int:
    """How many pages a worker's cache gets: `num_pages` when set; on a GPU, the given fraction of the memory
    free now (after the weights are loaded), but never more than `utilization` of the GPU's memory less what
    is in use now and `reserve_bytes` (the activations, buffers and workspace of the largest step:
    `engine.rank_memory.worker_reserve_bytes`), as `pdserve plan` counts it; on the CPU, `cpu_cache_bytes`."""
    if num_pages is not None:
        return num_pages
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks the load cached and freed count as in use below
        free, total = torch.cuda.mem_get_info(device)
        usable = int(total * utilization) - (total - free)
        budget = min(int(free * gpu_memory_fraction), usable - reserve_bytes)
    else:
        budget = cpu_cache_bytes
    pages = budget // layout.page_bytes
    if pages < 1:
        raise ValueError(
            f"no room for one KV page of {layout.page_bytes} bytes on {device}"
            + (f" after a reserve of {reserve_bytes / 2**30:.2f} GiB for the largest step's activations "
               "and buffers (fewer --max-num-batched-tokens or more GPUs)" if reserve_bytes else "")
        )  # fmt: skip
    return pages
