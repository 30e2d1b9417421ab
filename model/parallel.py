"""How one worker's model is split over its ranks: `WorkerLayout` (the split itself, as the pool configs, the
memory plan and every rank share it) and `ParallelLayout` (one rank's place in it, passed to `Transformer` and
the loader).

A worker of N ranks runs one of these layouts, all over one torch.distributed group of the N ranks:
- attention data-parallel (each rank the full attention weights and its own requests and KV pages) or
  tensor-parallel (the heads split evenly: wq_b and wkv_b rows by head, wo columns by head, an all-reduce after
  wo; wq_a / wkv_a replicated, so MLA's latent cache [c_kv | k_pe] is the same on every rank);
- MoE expert-parallel of size 1 (every rank all routed experts) or N (rank r holds experts [r*E/N, (r+1)*E/N),
  tokens exchanged through `pdserve.model.expert_exchange`, which `exchange` and `max_tokens_per_rank` choose);
- dense layers and shared experts replicated, or tensor-parallel (intermediate dim split, all-reduce after w2),
  which needs the same tokens on every rank, so only with tensor-parallel attention.

The default, `ParallelLayout()`, is one rank: the model then takes exactly its single-GPU code path. Pure Python
at import (no torch): the configs and the command line import `WorkerLayout`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from .args import ModelArgs
from .errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

ATTENTION_MODES = ("data", "tensor")
DENSE_MODES = ("replicated", "tensor")
ExchangeKind = Literal["auto", "all_gather", "all_to_all", "symmetric"]
EXCHANGE_KINDS = ("auto", "all_gather", "all_to_all", "symmetric")


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerLayout:
    """How one worker spreads the model over its ranks. Its fields are the pool configs' keys
    (`prefill.ranks`, `decode.attention`, ...), so plain `str` and `int`, checked here: construction checks
    that they describe a layout (modes known, EP dividing the ranks); `check_runnable` adds what the ranks
    can run, which the memory plan does not ask (it also plans EP groups smaller than the worker)."""

    ranks: int = 1
    """Ranks (one GPU each, or CPU processes) of one worker; 1: the worker is one process."""
    attention: str = "data"
    """Attention over the ranks: 'data' (each rank its own requests and KV pages) or 'tensor' (heads split)."""
    expert_parallel: int = 1
    """Ranks the routed experts are split over: 1 (each rank all of them) or `ranks`."""
    dense: str = "replicated"
    """Dense layers and shared experts: 'replicated' or 'tensor' (split; needs attention 'tensor')."""
    redundant_experts: int = 0
    """Spare routed-expert slots per MoE layer over the expert-parallel group (a multiple of
    expert_parallel, each rank an equal share): they hold copies of the hottest experts, which the rank
    holding an expert's home copy would otherwise compute alone, so that a skewed routing spreads over the
    ranks (`pdserve.model.expert_balance`). 0: off. Each slot costs one routed expert's weights per MoE
    layer on its rank."""
    rebalance_steps: int = 1000
    """Steps between two placements of the spare slots (with redundant_experts): the experts' loads
    counted over these steps choose the copies, which then move a few layers a step."""
    overlap_rows: int = 0
    """Decode steps of at least this many rows a rank (the step's largest rank, or its CUDA-graph bucket), and
    prefill passes of at least this many tokens, run as two micro-batches, each one's expert exchange in
    flight while the other computes (two-batch overlap; data-parallel attention with expert_parallel > 1 and
    the all-gather exchange). 0: never."""

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ConfigError(f"ranks={self.ranks}: must be >= 1")
        if self.attention not in ATTENTION_MODES:
            raise ConfigError(
                f"attention={self.attention!r}: expected one of {', '.join(ATTENTION_MODES)}"
            )
        if self.dense not in DENSE_MODES:
            raise ConfigError(f"dense={self.dense!r}: expected one of {', '.join(DENSE_MODES)}")
        if self.expert_parallel < 1 or self.ranks % self.expert_parallel:
            raise ConfigError(
                f"expert_parallel={self.expert_parallel}: must divide ranks={self.ranks}"
            )
        if self.redundant_experts < 0 or self.redundant_experts % self.expert_parallel:
            raise ConfigError(
                f"redundant_experts={self.redundant_experts}: must be >= 0 and a multiple of "
                f"expert_parallel={self.expert_parallel} (each rank an equal share)"
            )
        if self.redundant_experts and self.expert_parallel == 1:
            raise ConfigError(
                f"redundant_experts={self.redundant_experts}: needs expert_parallel > 1 (with one "
                "expert-parallel rank every rank holds every expert)"
            )
        if self.rebalance_steps < 1:
            raise ConfigError(f"rebalance_steps={self.rebalance_steps}: must be >= 1")
        if self.overlap_rows and (self.overlap_rows < 2 or self.expert_parallel == 1):
            raise ConfigError(
                f"overlap_rows={self.overlap_rows}: must be 0 (off) or >= 2 rows, with expert_parallel "
                f"> 1 (got {self.expert_parallel}): two micro-batches overlap the expert exchange"
            )

    def check_runnable(self) -> None:
        """Raises ConfigError naming the field when the ranks cannot run this layout: experts split over all
        ranks or none, and tensor-parallel dense layers only where every rank holds the same tokens."""
        if self.expert_parallel not in (1, self.ranks):
            raise ConfigError(
                f"expert_parallel={self.expert_parallel}: must be 1 or ranks={self.ranks}"
            )
        if self.overlap_rows and self.attention != "data":
            raise ConfigError(
                f"overlap_rows={self.overlap_rows}: needs attention='data' (with tensor-parallel attention "
                "every rank holds the same tokens and there is no exchange to overlap)"
            )
        if self.dense == "tensor" and self.attention != "tensor" and self.ranks > 1:
            raise ConfigError(
                "dense='tensor': needs attention='tensor' (with data-parallel attention the ranks hold "
                "different tokens)"
            )

    @property
    def attention_tp_size(self) -> int:
        """Ranks the attention heads are split over (1 with data-parallel attention)."""
        return self.ranks if self.attention == "tensor" else 1

    @property
    def attention_dp_size(self) -> int:
        """Ranks holding different requests and so their own KV pages: `ranks` with data-parallel attention,
        else 1 (tensor-parallel attention replicates MLA's latent cache on every rank)."""
        return self.ranks // self.attention_tp_size

    @property
    def dense_tp_size(self) -> int:
        """Ranks the dense layers' and shared experts' intermediate dim is split over."""
        return self.ranks if self.dense == "tensor" else 1

    @property
    def spare_slots(self) -> int:
        """Spare routed-expert slots per MoE layer on each rank (`redundant_experts` shared evenly)."""
        return self.redundant_experts // self.expert_parallel

    @property
    def same_tokens_on_all_ranks(self) -> bool:
        """Every rank runs the same tokens through the MoE layers (tensor-parallel attention)."""
        return self.attention_dp_size == 1

    def check_model(self, args: ModelArgs) -> None:
        """Raises `ConfigError` naming the dimension that this layout cannot split evenly."""
        checks = [
            ("num_attention_heads", args.num_attention_heads, self.attention_tp_size),
            ("n_routed_experts", args.n_routed_experts, self.expert_parallel),
            ("intermediate_size", args.intermediate_size, self.dense_tp_size),
        ]
        if args.n_shared_experts:
            shared = args.moe_intermediate_size * args.n_shared_experts
            checks.append(("moe_intermediate_size * n_shared_experts", shared, self.dense_tp_size))
        for name, value, parts in checks:
            if value % parts:
                raise ConfigError(
                    f"parallel layout: {name}={value} does not split over {parts} ranks"
                )


def rows_per_rank(max_running: int | None, dp_ranks: int) -> int | None:
    """A worker's `max_running` requests shared by its `dp_ranks` data-parallel ranks: the most one rank holds
    (and so the largest decode batch its graphs need); None: no limit."""
    return None if max_running is None else -(-max_running // dp_ranks)


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelLayout:
    """One rank's place in its worker's `WorkerLayout`, and how its collectives run."""

    worker: WorkerLayout = WorkerLayout()
    """The worker's split over its ranks (checked runnable)."""
    rank: int = 0
    """This process's rank in `group`, 0 <= rank < worker.ranks."""
    exchange: ExchangeKind = "auto"
    """Expert exchange with data-parallel attention and expert_parallel > 1 (`expert_exchange.make_exchange`):
    'all_gather' (every rank gathers every rank's tokens), 'all_to_all' (a token goes only to its experts'
    ranks), 'symmetric' (the all-gather's rows by one-sided copies over torch symmetric memory; CUDA) or
    'auto' (all-gather for small expert-parallel groups)."""
    dispatch_fp8: bool = True
    """Where the experts are fp8, the exchange carries a token's rows quantized (1x128 groups, as their GEMM
    takes them): about half the bytes of the activation dtype, the same bits as quantizing at the experts, and
    each token quantized once by its own rank instead of by every rank it reaches, so a decode step whose
    exchange is bound by its bytes gets faster. False: the rows travel in the activation dtype."""
    max_tokens_per_rank: int | None = None
    """Most tokens a rank runs in one step, the same bound on every rank: the all-gather exchange pads to it
    (no host sync, so CUDA graphs can capture it) and refuses a step with more. None: padded per step to the
    largest rank's count, found by a small collective and a host sync."""
    expert_chunk_tokens: int = 16384
    """Most exchanged tokens one launch of a rank's experts runs: the all-gather exchange hands each rank every
    rank's tokens (N x the step's), and the experts' working set (each token's k permuted rows, their
    intermediate and their outputs: about 23 KiB a token for V3) grows with them, so a pass over more runs
    in chunks of this many tokens. 16384: two launches for a DP4 + EP4 prefill of 8192 tokens a rank (about
    3 GiB of working set for V3 instead of 6), one for every decode step."""
    group: ProcessGroup | None = dataclasses.field(default=None, compare=False)
    """The torch.distributed group of the worker's ranks (None: the default group). Every collective of the
    layout (attention and dense all-reduces, the expert exchange) runs on it, issued in the same order on
    every rank."""

    def __post_init__(self) -> None:
        self.worker.check_runnable()
        if not 0 <= self.rank < self.worker.ranks:
            raise ConfigError(
                f"parallel layout: rank={self.rank} outside [0, ranks={self.worker.ranks})"
            )
        if self.exchange not in EXCHANGE_KINDS:
            raise ConfigError(
                f"parallel layout: exchange={self.exchange!r}, expected one of {EXCHANGE_KINDS}"
            )
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < 1:
            raise ConfigError(
                f"parallel layout: max_tokens_per_rank={self.max_tokens_per_rank} must be >= 1 or None"
            )
        if self.expert_chunk_tokens < 1:
            raise ConfigError(
                f"parallel layout: expert_chunk_tokens={self.expert_chunk_tokens} must be >= 1"
            )

    @property
    def ep_rank(self) -> int:
        return self.rank if self.worker.expert_parallel > 1 else 0

    def local_experts(self, num_experts: int) -> range:
        """Global ids of the routed experts this rank holds, a contiguous range."""
        per_rank = num_experts // self.worker.expert_parallel
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def shard(self, size: int, parts: int) -> tuple[int, int]:
        """This rank's [start, stop) of a dimension of `size` split evenly over `parts` ranks (1: all)."""
        if parts == 1:
            return 0, size
        per_rank = size // parts
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the group in place and returns it."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x


SINGLE_RANK = ParallelLayout()
