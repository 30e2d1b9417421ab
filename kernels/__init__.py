"""pdserve's kernel library: one package per op, each a torch reference (`ref.py`, the spec) and a Triton
implementation (`triton.py`), chosen per call by `_backend` (Triton on CUDA, the reference on CPU, or forced with
`PDSERVE_KERNELS=ref|triton` / `use_backend`). No model logic lives here.

What several ops share lives in modules of its own here, never in one op's private names: `fp8_quant` (fp8
constants and the torch quantizers) and `fp8_quant_triton` (their Triton counterparts), `tile_order` (the GEMMs'
grouped tile order), `gluon_sm90_common` (the Hopper Gluon kernels' imports and building blocks), and the latent
cache's row format and writers' pieces: `kv_row_fp8` (the fp8 row layout and its torch codec), `kv_row_triton`
(slot addressing and the row quantizer in Triton), `kv_cache_checks` (the writers' input checks). The torch-only
ones import without Triton.

| module | its one job |
|---|---|
| `fp8_gemm/` | FP8 block-scaled GEMM |
| `fused_moe/` | fused MoE |
| `matmul/` | dense matmuls |
| `mla_decode/` | MLA decode attention and the cache writers |
| `mla_prefill/` | MLA prefill attention |
| `moe_route/` | noaux_tc routing |
| `rmsnorm/` | RMSNorm (+ residual) |
| `rope/` | RoPE |
| `sampling/` | batched sampling |
| `silu_mul/` | SiLU-mul |
| `fp8_quant` | fp8 constants and the torch quantizers |
| `fp8_quant_triton` | their Triton counterparts |
| `tile_order` | the GEMMs' grouped tile order |
| `gluon_sm90_common` | the Hopper Gluon kernels' building blocks |
| `kv_row_fp8` | the fp8 latent-cache row format and its torch codec |
| `kv_row_triton` | slot addressing and the row quantizer in Triton |
| `kv_cache_checks` | the cache writers' input checks |
| `tuning` | tuned launch configurations per op, shape class and device |
"""

from ._backend import (
    BACKEND_ENV,
    INVARIANT_ENV,
    backend_for,
    batch_invariant,
    forward_phase,
    use,
    use_backend,
    use_batch_invariant,
)
from .fp8_gemm import dequantize_weight, fp8_gemm, quantize_act, quantize_weight, scaled_gemm
from .fused_moe import fused_moe
from .matmul import head_matmul, linear
from .mla_decode import mla_decode, write_kv, write_kv_fp8
from .mla_prefill import merge_attn_states, mla_prefill
from .moe_route import moe_route
from .rmsnorm import rmsnorm
from .rope import rope
from .sampling import sample
from .silu_mul import silu_mul

__all__ = [
    "BACKEND_ENV",
    "INVARIANT_ENV",
    "backend_for",
    "batch_invariant",
    "dequantize_weight",
    "fp8_gemm",
    "forward_phase",
    "fused_moe",
    "head_matmul",
    "linear",
    "merge_attn_states",
    "mla_decode",
    "mla_prefill",
    "moe_route",
    "quantize_act",
    "quantize_weight",
    "rmsnorm",
    "rope",
    "sample",
    "scaled_gemm",
    "silu_mul",
    "use",
    "use_backend",
    "use_batch_invariant",
    "write_kv",
    "write_kv_fp8",
]
