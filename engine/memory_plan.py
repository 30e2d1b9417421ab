"""The memory plan of one worker: per rank its weights by group, its activation and workspace reserve
(`rank_memory`), and the KV cache pages the rest of the GPU holds; whether that fits, and if not, what falls short
and which single change would fit.

A pure function of its inputs (`ModelArgs`, the weights' dtype, a `WorkerLayout`, `PlanSettings`): it needs no GPU
and reads no weights, so `pdserve plan` answers "does this layout fit, and how much KV does it hold?" before any
machine is taken, and a worker checks its layout at startup before loading anything (`plan_memory`, then
`MemoryPlan.check`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from pdserve.engine.rank_memory import (
    GIB,
    GPU_MEMORY_UTILIZATION,
    GROUPS,
    check_split,
    reserve_bytes_per_rank,
    weight_bytes_per_rank,
)
from pdserve.model.args import ModelArgs
from pdserve.model.errors import ConfigError
from pdserve.model.kv_cache import KVCacheLayout, resolve_cache_dtype
from pdserve.model.parallel import WorkerLayout, rows_per_rank

__all__ = [
    "MemoryPlan",
    "MemoryPlanError",
    "PlanSettings",
    "model_for_plan",
    "plan_memory",
]


@dataclasses.dataclass(frozen=True, slots=True)
class PlanSettings:
    """The memory and serving limits a plan is made for."""

    gpu_memory_gib: float = 80.0
    """Memory of each GPU, GiB."""
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    """Share of each GPU's memory the worker uses in all (weights, reserve, KV), as vLLM's gpu_memory_utilization;
    the rest is left to other processes and to what no plan sees."""
    page_size: int = 64
    """Tokens per KV page."""
    kv_cache_dtype: str = "auto"
    """KV rows: auto (the model dtype) or fp8 (e4m3 latent with a per-token scale)."""
    max_num_batched_tokens: int = 8192
    """Tokens one rank runs in one forward pass at most (a prefill step's token budget)."""
    max_running: int = 256
    """Requests of the worker in one step at most, shared by its data-parallel ranks (a rank's decode step's
    tokens, and the rows of logits of any step)."""
    max_model_len: int | None = None
    """Longest request (prompt + output) the KV cache must hold; None: the model's max_position_embeddings."""
    use_mtp: bool = True
    """Count the checkpoint's multi-token-prediction modules (weights and their cache layers)."""
    host_kv_cache_gib: float = 0.0
    """Host memory of the host tier below the prefix cache, GiB per KV page set (`host_kv_cache_bytes` of a
    worker's config: pinned memory holding the cached pages the GPU evicts); 0: off."""

    def __post_init__(self) -> None:
        if not self.gpu_memory_gib > 0:
            raise ConfigError(f"gpu_memory_gib={self.gpu_memory_gib}: must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]"
            )
        for name in ("page_size", "max_num_batched_tokens", "max_running"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be positive")
        if self.host_kv_cache_gib < 0:
            raise ConfigError(f"host_kv_cache_gib={self.host_kv_cache_gib}: must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len={self.max_model_len}: must be positive")


class MemoryPlanError(ConfigError):
    """The layout does not fit the GPUs: the message names what falls short, by how much, and what to change."""


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Per-rank memory of one worker (every rank of a layout holds the same amounts). Bytes throughout."""

    layout: WorkerLayout
    settings: PlanSettings
    weight_format: str
    """fp8 (block-quantized checkpoint), bf16, fp16 or fp32."""
    num_layers: int
    num_mtp: int
    weight_bytes: dict[str, int]
    """By group: GROUPS, then DERIVED_GROUPS."""
    reserve_bytes: dict[str, int]
    gpu_bytes: int
    usable_bytes: int
    """gpu_bytes * gpu_memory_utilization."""
    page_bytes: int
    """One KV page across all cached layers."""
    num_pages: int
    """KV pages per rank (0 when the weights and reserve do not fit)."""
    max_model_len: int
    shortfall: str | None
    """None when the layout fits; else what falls short and what to change."""

    @property
    def fits(self) -> bool:
        return self.shortfall is None

    @property
    def total_weight_bytes(self) -> int:
        return sum(self.weight_bytes.values())

    @property
    def checkpoint_bytes(self) -> int:
        """The rank's share of the checkpoint's tensors (weights and scales), excluding derived groups."""
        return sum(self.weight_bytes[g] for g in GROUPS)

    @property
    def total_reserve_bytes(self) -> int:
        return sum(self.reserve_bytes.values())

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV one rank holds."""
        return self.num_pages * self.settings.page_size

    @property
    def host_pages(self) -> int:
        """Pages of the host tier's pool per KV page set (0: off)."""
        return int(self.settings.host_kv_cache_gib * GIB) // self.page_bytes

    @property
    def worker_pages(self) -> int:
        """Distinct KV pages of the whole worker (DP: every rank's own; TP: one replicated set)."""
        return self.num_pages * self.layout.attention_dp_size

    @property
    def worker_tokens(self) -> int:
        return self.worker_pages * self.settings.page_size

    @property
    def free_bytes(self) -> int:
        """What the plan leaves unused on each GPU (the utilization margin and less than one page)."""
        return self.gpu_bytes - self.total_weight_bytes - self.total_reserve_bytes - self.kv_bytes

    def check(self) -> None:
        """Raises MemoryPlanError naming the shortfall when the layout does not fit."""
        if self.shortfall is not None:
            raise MemoryPlanError(self.shortfall)

    def format_table(self, title: str = "") -> str:
        """The plan as a plain-text table (GiB per rank, then the worker's KV capacity)."""
        s, lay = self.settings, self.layout
        head = title or "model"
        mtp = f" + {self.num_mtp} MTP" if self.num_mtp else ""
        lines = [
            f"{head}: {self.num_layers - self.num_mtp} layers{mtp}, {self.weight_format} weights",
            f"layout: {_describe(lay)} ({lay.ranks} GPUs of {s.gpu_memory_gib:g} GiB, "
            f"utilization {s.gpu_memory_utilization:g}: {_gib(self.usable_bytes)} GiB usable)",
            f"{'per rank':<44}{'GiB':>10}",
            "weights",
        ]
        row = "  {:<42}{:>10}"
        for group, nbytes in self.weight_bytes.items():
            if nbytes or group in GROUPS:
                lines.append(row.format(group, _gib(nbytes)))
        lines.append(row.format("total", _gib(self.total_weight_bytes)))
        rows = _rows_per_rank(s, lay)
        lines.append(
            f"reserve ({self._step_tokens()} tokens per step, {rows} running a rank of the worker's "
            f"{s.max_running})"
        )
        for name, nbytes in self.reserve_bytes.items():
            lines.append(row.format(name, _gib(nbytes)))
        lines.append(row.format("total", _gib(self.total_reserve_bytes)))
        row_kv = f"{'KV cache':<44}{_gib(self.kv_bytes):>10}"
        per_token = self.page_bytes / s.page_size
        lines.append(
            f"{row_kv}   {self.num_pages} pages x {s.page_size} = {self.kv_tokens} tokens "
            f"({per_token / 1024:.1f} KiB per token, {s.kv_cache_dtype} rows)"
        )
        lines.append(f"{'free':<44}{_gib(self.free_bytes):>10}   of {_gib(self.gpu_bytes)}")
        if self.host_pages:
            host = self.host_pages * self.page_bytes
            lines.append(
                f"{'host KV tier (pinned host memory)':<44}{_gib(host):>10}   {self.host_pages} pages x "
                f"{s.page_size} = {self.host_pages * s.page_size} tokens per KV page set"
            )
        groups = lay.attention_dp_size
        lines.append(
            f"per worker ({lay.ranks} ranks, {groups} KV page set{'s' if groups > 1 else ''}): "
            f"{self.worker_pages} pages, {self.worker_tokens} tokens of KV; "
            f"longest request {self.max_model_len} tokens"
        )
        lines.append("fits" if self.fits else "does not fit")  # the reason: `check`'s error
        return "\n".join(lines)

    def _step_tokens(self) -> int:
        return _step_tokens(self.settings, self.layout)


def _rows_per_rank(settings: PlanSettings, layout: WorkerLayout) -> int:
    """The running requests one rank holds at most: the worker's shared by its data-parallel ranks."""
    return rows_per_rank(settings.max_running, layout.attention_dp_size)


def _step_tokens(settings: PlanSettings, layout: WorkerLayout) -> int:
    return max(settings.max_num_batched_tokens, _rows_per_rank(settings, layout))


def plan_memory(
    args: ModelArgs, dtype: torch.dtype, layout: WorkerLayout, settings: PlanSettings
) -> MemoryPlan:
    """The memory plan of `layout` for a model of `args` whose non-fp8 weights and activations are `dtype`.

    Never raises for a layout that does not fit (see `MemoryPlan.shortfall` / `check`); raises ConfigError when the
    layout cannot split this model (EP not dividing the experts, TP not dividing the heads or a quant block)."""
    plan = _plan(args, dtype, layout, settings)
    if plan.fits:
        return plan
    return dataclasses.replace(plan, shortfall=_shortfall(plan, args, dtype))


def _plan(
    args: ModelArgs, dtype: torch.dtype, layout: WorkerLayout, settings: PlanSettings
) -> MemoryPlan:
    check_split(args, layout)
    num_mtp = args.num_nextn_predict_layers if settings.use_mtp else 0
    weights = weight_bytes_per_rank(args, dtype, layout, num_mtp)
    rows = _rows_per_rank(settings, layout)
    reserve = reserve_bytes_per_rank(args, dtype, layout, _step_tokens(settings, layout), rows)
    cache_dtype = resolve_cache_dtype(settings.kv_cache_dtype, dtype)
    kv_layout = KVCacheLayout.for_model(args, settings.page_size, cache_dtype, num_mtp)
    gpu_bytes = int(settings.gpu_memory_gib * GIB)
    usable = int(gpu_bytes * settings.gpu_memory_utilization)
    room = usable - sum(weights.values()) - sum(reserve.values())
    num_pages = max(0, room // kv_layout.page_bytes)
    max_model_len = settings.max_model_len or args.max_position_embeddings
    if room < 0:
        shortfall = "weights"
    elif num_pages * settings.page_size < max_model_len:
        shortfall = "kv"
    else:
        shortfall = None
    return MemoryPlan(
        layout, settings, _weight_format(args, dtype), args.num_hidden_layers + num_mtp, num_mtp,
        weights, reserve, gpu_bytes, usable, kv_layout.page_bytes, num_pages, max_model_len,
        shortfall,
    )  # fmt: skip


def _shortfall(plan: MemoryPlan, args: ModelArgs, dtype: torch.dtype) -> str:
    """One line: what falls short, by how much, and the single changes of layout or settings that would fit."""
    s = plan.settings
    fixed = plan.total_weight_bytes + plan.total_reserve_bytes
    usable = f"the {_gib(plan.usable_bytes)} GiB usable ({s.gpu_memory_gib:g} GiB x {s.gpu_memory_utilization:g})"
    fixes = [
        f"{flag} ({fixed_plan.kv_tokens} KV tokens per rank)"
        for flag, fixed_plan in _alternatives(plan, args, dtype)
        if fixed_plan.fits
    ]
    change = "; ".join(fixes) if fixes else "no single change of GPUs, layout or KV dtype fits"
    if plan.shortfall == "weights":
        return (
            f"each rank needs {_gib(plan.total_weight_bytes)} GiB of weights + "
            f"{_gib(plan.total_reserve_bytes)} GiB reserve = {_gib(fixed)} GiB, "
            f"{_gib(fixed - plan.usable_bytes)} GiB more than {usable}; fits with: {change}"
        )
    need = -(-plan.max_model_len // s.page_size) * plan.page_bytes
    return (
        f"KV cache of {_gib(plan.kv_bytes)} GiB per rank holds {plan.kv_tokens} tokens, below one "
        f"{plan.max_model_len}-token request ({_gib(need)} GiB, {_gib(need - plan.kv_bytes)} GiB short) "
        f"after {_gib(fixed)} GiB of weights and reserve in {usable}; fits with: {change}, "
        "or a smaller --max-model-len"
    )


_MAX_DOUBLINGS = 8


def _alternatives(
    plan: MemoryPlan, args: ModelArgs, dtype: torch.dtype
) -> list[tuple[str, MemoryPlan]]:
    """Plans of single changes to `plan`, as the flags that make them: the first of 2x, 4x, ... GPUs that fits
    (EP growing with them when it spans all ranks), TP attention, TP dense, EP over every rank, fp8 KV, and the
    largest halving of --max-num-batched-tokens that fits. Changes this model cannot split are left out."""
    lay, s = plan.layout, plan.settings
    candidates: list[tuple[str, WorkerLayout, PlanSettings]] = []
    for j in range(1, _MAX_DOUBLINGS + 1):
        n = lay.ranks << j
        ep = n if lay.expert_parallel == lay.ranks else lay.expert_parallel
        spares = lay.spare_slots * ep  # the same spare slots a rank
        grown = dataclasses.replace(lay, ranks=n, expert_parallel=ep, redundant_experts=spares)
        flags = f"--gpus {n}" + (
            f" --redundant-experts {spares}" if spares != lay.redundant_experts else ""
        )
        candidates.append((flags, grown, s))
    if lay.ranks > 1 and lay.attention == "data":
        candidates.append(("--attention tp", dataclasses.replace(lay, attention="tensor"), s))
    if lay.ranks > 1 and lay.dense == "replicated":
        candidates.append(("--dense tp", dataclasses.replace(lay, dense="tensor"), s))
    if lay.expert_parallel < lay.ranks and not lay.redundant_experts:
        ep_all = dataclasses.replace(lay, expert_parallel=lay.ranks)
        candidates.append((f"--ep {lay.ranks}", ep_all, s))
    if s.kv_cache_dtype != "fp8":
        candidates.append(
            ("--kv-cache-dtype fp8", lay, dataclasses.replace(s, kv_cache_dtype="fp8"))
        )
    tokens = s.max_num_batched_tokens // 2
    while tokens >= s.max_running:
        fewer = dataclasses.replace(s, max_num_batched_tokens=tokens)
        candidates.append((f"--max-num-batched-tokens {tokens}", lay, fewer))
        tokens //= 2
    out: list[tuple[str, MemoryPlan]] = []
    for flag, layout, settings in candidates:
        if any(flag.split()[0] == done.split()[0] for done, _ in out):
            continue  # the first fitting step of a series is the advice
        try:
            alternative = _plan(args, dtype, layout, settings)
        except ConfigError:
            continue
        if alternative.fits:
            out.append((flag, alternative))
    return out


def _describe(layout: WorkerLayout) -> str:
    """The layout as `pdserve plan` prints it, in its flags' terms: `attention-DP8 + EP8, dense replicated`."""
    attention = "TP" if layout.attention == "tensor" else "DP"
    dense = "tp" if layout.dense == "tensor" else "replicated"
    return f"attention-{attention}{layout.ranks} + EP{layout.expert_parallel}, dense {dense}"


def _weight_format(args: ModelArgs, dtype: torch.dtype) -> str:
    if args.quantization is not None:
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"


def model_for_plan(
    model_dir: str | None = None,
    preset: str | None = None,
    layers: int | None = None,
    preset_dtype: str = "fp8",
) -> tuple[ModelArgs, torch.dtype]:
    """The arguments and weight dtype a plan needs, from a checkpoint's config.json (no weights read) or from a
    preset of `make-checkpoint` (`layers` overriding its main layer count, `preset_dtype` its weight format)."""
    from pdserve.model.random_checkpoint import preset_config

    if (model_dir is None) == (preset is None):
        raise ConfigError("give a checkpoint directory or a preset, not both or neither")
    if model_dir is not None:
        if layers is not None:
            raise ConfigError("--layers applies to --preset only (a checkpoint has its own)")
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"--model {model_dir}: no config.json (is this a checkpoint directory?)"
            )
        try:
            config = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path / 'config.json'}: not valid JSON ({e})") from e
    else:
        config = preset_config(preset, layers, preset_dtype)
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if name not in _CONFIG_DTYPES:
        raise ConfigError(f"torch_dtype={name!r}: expected one of {', '.join(_CONFIG_DTYPES)}")
    return ModelArgs.from_dict(config), _CONFIG_DTYPES[name]


_CONFIG_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
