"""Distils a random checkpoint's MTP module onto its own main model (`pdserve make-checkpoint --distill-mtp`).

On random weights the MTP module drafts noise, so speculative-decoding acceptance means nothing. `distill_mtp`
teaches it its target: the main model continues random prompts greedily (the serving forward, paged cache and
all); one prefill over each whole sequence then gives the final-norm hidden states h_t and the main model's
greedy token after each position. MTP module 0 is trained (`TrainableMTP`, which says what trains and what stays
frozen) so that from (h_t, token t+1) it predicts the main model's greedy token at t+2: cross entropy on that
argmax, on every row. The held-out agreement of its argmax with that target, over the rows a decode step drafts
from (token t+1 generated, not prompt), is the acceptance a one-token greedy draft would reach. The trained
tensors are written back into the checkpoint's shards under their own names and dtypes (fp8 ones re-quantized
in 128x128 blocks); every other tensor is rewritten bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from ..kernels.fp8_quant import quantize_weight
from .args import ModelArgs
from .batch import SeqChunk, build_forward_batch
from .deepseek import Transformer
from .errors import CheckpointError, ConfigError
from .kv_cache import KVCacheLayout, PagedKVCache
from .loader import load_model, read_checkpoint_tensors
from .mtp_train import TrainableMTP
from .weight_names import checkpoint_weights, scale_spec

PAGE_SIZE = 64
"""KV page size of the data-generating passes (the attention kernels' whole tile)."""
GEN_BATCH = 32
"""Sequences generated per batch."""
LOGITS_ROWS = 4096
"""Rows of main-model logits computed at a time (an argmax each), so [rows, V] fp32 stays small."""


@dataclasses.dataclass(frozen=True, slots=True)
class DistillConfig:
    steps: int
    """Optimizer steps."""
    lr: float = 1e-3
    """Peak AdamW learning rate (linear warmup over the first 5% of steps, then cosine to a tenth)."""
    seq_len: int = 128
    """Tokens per training sequence: the random prompt, then the main model's greedy continuation."""
    prompt_len: int = 8
    """Random prompt tokens at the start of each sequence."""
    batch_size: int = 8
    """Sequences per step."""
    train_sequences: int = 256
    """Sequences generated for training (drawn from at random each step)."""
    eval_sequences: int = 32
    """Held-out sequences the agreement is measured on."""
    device: str = "cpu"
    """Where the model runs and trains (cpu, cuda, cuda:N)."""
    seed: int = 0
    """Seeds the prompts, the batches drawn and nothing else (training is otherwise deterministic on CPU)."""
    log_every: int = 0
    """Steps between progress lines; 0: a twentieth of the steps."""

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "prompt_len", "batch_size", "train_sequences"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be positive")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ConfigError(f"lr={self.lr}: must be a positive number")
        if self.seq_len < self.prompt_len + 2:
            raise ConfigError(
                f"seq_len={self.seq_len}: must exceed prompt_len={self.prompt_len} by 2 or more "
                "(a draft row needs a generated token and the greedy token after it)"
            )
        if self.eval_sequences < 1:
            raise ConfigError(f"eval_sequences={self.eval_sequences}: must be positive")
        if self.log_every < 0:
            raise ConfigError(f"log_every={self.log_every}: must be 0 or positive")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ConfigError(f"device={self.device!r}: not a torch device ({e})") from e
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={self.device!r}: CUDA is not available here")
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}: expected cpu or cuda[:N]")


@dataclasses.dataclass(frozen=True, slots=True)
class DistillResult:
    initial_agreement: float
    """Held-out top-1 agreement of the untrained module with the main model's greedy token."""
    final_agreement: float
    """The same after training: the one-token greedy acceptance the draft would reach."""
    final_loss: float
    """Held-out cross entropy after training."""
    tensors_written: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Data:
    hidden: torch.Tensor  # [N, S-1, D]: h_t at positions 0..S-2, the model's dtype
    next_ids: torch.Tensor  # [N, S-1]: tokens at positions 1..S-1
    targets: torch.Tensor  # [N, S-1]: the main model's greedy token after position t+1


def _continue_greedily(model: Transformer, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts: [B, P] -> [B, P + new_tokens]: each prompt continued greedily, a prefill then decode steps."""
    device = model.embed.weight.device
    bsz, plen = prompts.shape
    pages_per_seq = -(-(plen + new_tokens) // PAGE_SIZE)
    layout = KVCacheLayout.for_model(model.args, PAGE_SIZE, model.dtype)
    cache = PagedKVCache(layout, bsz * pages_per_seq, device)
    pages = [range(b * pages_per_seq, (b + 1) * pages_per_seq) for b in range(bsz)]
    rows = prompts.tolist()
    chunks = [SeqChunk(rows[b], 0, pages[b]) for b in range(bsz)]
    batch = build_forward_batch(chunks, PAGE_SIZE, device, decode=False)
    out = [prompts.to(device)]
    with torch.inference_mode():
        for step in range(new_tokens):
            hidden = model(batch, cache)
            token = model.compute_logits(hidden[batch.logits_indices]).argmax(-1)  # [B]
            out.append(token[:, None])
            if step + 1 < new_tokens:
                ids = token.tolist()
                chunks = [SeqChunk([ids[b]], plen + step, pages[b]) for b in range(bsz)]
                batch = build_forward_batch(chunks, PAGE_SIZE, device, decode=True)
    return torch.cat(out, dim=1)


def _hidden_and_greedy(model: Transformer, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs: [B, S] -> final-norm hidden [B, S, D] and the main model's greedy next token [B, S], from one
    prefill over the whole sequences."""
    device = model.embed.weight.device
    bsz, seq = seqs.shape
    pages_per_seq = -(-seq // PAGE_SIZE)
    layout = KVCacheLayout.for_model(model.args, PAGE_SIZE, model.dtype)
    cache = PagedKVCache(layout, bsz * pages_per_seq, device)
    rows = seqs.tolist()
    chunks = [
        SeqChunk(rows[b], 0, range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(bsz)
    ]
    batch = build_forward_batch(chunks, PAGE_SIZE, device, decode=False)
    with torch.inference_mode():
        hidden = model(batch, cache)  # [B * S, D]
        greedy = torch.cat([
            model.compute_logits(hidden[i : i + LOGITS_ROWS]).argmax(-1)
            for i in range(0, hidden.shape[0], LOGITS_ROWS)
        ])  # fmt: skip
    # clone: inference tensors cannot be saved for the backward pass
    return hidden.clone().view(bsz, seq, -1), greedy.clone().view(bsz, seq)


def _make_data(
    model: Transformer, count: int, config: DistillConfig, gen: torch.Generator
) -> _Data:
    parts = []
    vocab = model.args.vocab_size
    for start in range(0, count, GEN_BATCH):
        bsz = min(GEN_BATCH, count - start)
        prompts = torch.randint(0, vocab, (bsz, config.prompt_len), generator=gen)
        seqs = _continue_greedily(model, prompts, config.seq_len - config.prompt_len)
        hidden, greedy = _hidden_and_greedy(model, seqs)
        parts.append(_Data(hidden[:, :-1], seqs[:, 1:], greedy[:, 1:]))
    return _Data(
        *(torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(_Data))
    )


def _loss_and_hits(
    trainer: TrainableMTP, data: _Data, index: torch.Tensor, first_row: int, autocast: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mean cross entropy, the count of argmax hits and the rows counted, over the draft rows of the sequences
    `index`."""
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        logits = trainer(data.hidden[index], data.next_ids[index])[:, first_row:]  # [b, R, V]
    targets = data.targets[index][:, first_row:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    hits = (logits.argmax(-1) == targets).sum()
    return loss, hits, targets.numel()


def _evaluate(
    trainer: TrainableMTP, data: _Data, config: DistillConfig, autocast: bool
) -> tuple[float, float]:
    """Held-out (loss, agreement) over every eval sequence."""
    loss_sum, hits, rows = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, data.targets.shape[0], config.batch_size):
            index = torch.arange(start, min(start + config.batch_size, data.targets.shape[0]))
            loss, h, n = _loss_and_hits(trainer, data, index, config.prompt_len - 1, autocast)
            loss_sum += loss.item() * n
            hits += int(h)
            rows += n
    return loss_sum / rows, hits / rows


def _lr_factor(step: int, steps: int) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def distill_mtp(
    path: str | Path, config: DistillConfig, log: Callable[[str], None] = print
) -> DistillResult:
    """Trains MTP module 0 of the checkpoint at `path` on its main model's greedy continuations and writes the
    trained tensors back into its shards (the rest of the checkpoint unchanged). Progress goes to `log`."""
    path = Path(path)
    device = torch.device(config.device)
    autocast = device.type == "cuda"
    start = time.perf_counter()
    if ModelArgs.from_json(path).num_nextn_predict_layers == 0:
        raise ConfigError(f"{path}: config.json has no MTP module to distil")
    log(f"loading {path} on {device}")
    model = load_model(path, device, progress=False)
    if model.num_mtp == 0:
        raise ConfigError(f"{path}: the checkpoint holds no MTP module tensors to distil")
    args, num_mtp = model.args, model.num_mtp
    log(
        f"generating {config.train_sequences} + {config.eval_sequences} held-out sequences of "
        f"{config.seq_len} tokens ({config.prompt_len} random, then greedy) on {device}"
    )
    gen = torch.Generator().manual_seed(config.seed)
    train = _make_data(model, config.train_sequences, config, gen)
    held_out = _make_data(model, config.eval_sequences, config, gen)
    trainer = TrainableMTP(model, 0)
    del model  # the main layers: only the MTP module's frozen tensors stay referenced
    if device.type == "cuda":
        torch.cuda.empty_cache()
    loss0, agree0 = _evaluate(trainer, held_out, config, autocast)
    log(
        f"untrained: held-out loss {loss0:.4f}, agreement {agree0:.4f} "
        f"(data ready in {time.perf_counter() - start:.1f}s)"
    )
    opt = torch.optim.AdamW(trainer.parameters(), config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, config.steps))
    log_every = config.log_every or max(1, config.steps // 20)
    pick = torch.Generator().manual_seed(config.seed + 1)
    loss, agree = loss0, agree0
    for step in range(1, config.steps + 1):
        index = torch.randint(0, train.targets.shape[0], (config.batch_size,), generator=pick)
        # every row trains (its target is the main model's greedy token all the same); the prompt rows
        # add tokens the continuations rarely reach
        train_loss, _, _ = _loss_and_hits(trainer, train, index, 0, autocast)
        train_loss.backward()
        torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step % log_every == 0 or step == config.steps:
            loss, agree = _evaluate(trainer, held_out, config, autocast)
            log(
                f"step {step}/{config.steps}: train loss {train_loss.item():.4f}, held-out loss "
                f"{loss:.4f}, agreement {agree:.4f} ({time.perf_counter() - start:.1f}s)"
            )
    written = write_mtp_weights(path, args, num_mtp, trainer.trained())
    log(f"held-out agreement {agree0:.4f} -> {agree:.4f}; wrote {written} MTP tensors to {path}")
    return DistillResult(agree0, agree, loss, written)


def write_mtp_weights(
    path: Path, args: ModelArgs, num_mtp: int, trained: dict[str, torch.Tensor]
) -> int:
    """Writes `trained` (fp32 by `Transformer` parameter path) into the checkpoint's MTP tensors, each in its
    stored dtype (fp8 re-quantized, its scales replaced); returns the count of tensors replaced, scales
    included. Each shard touched is rewritten whole through a temporary file and renamed over the old one; its
    other tensors keep their bytes."""
    stored = read_checkpoint_tensors(path)
    updates: dict[str, dict[str, torch.Tensor]] = {}
    for spec in checkpoint_weights(args, num_mtp):
        if not spec.is_mtp or spec.param not in trained:
            continue
        value = trained[spec.param]
        if spec.expert is not None:
            value = value[spec.expert]
        if spec.rows is not None:
            value = value[spec.rows[0] : spec.rows[1]]
        entry = stored.get(spec.name)
        if entry is None or entry.shape != tuple(value.shape):
            raise CheckpointError(f"{spec.name}: not stored as {list(value.shape)} in {path}")
        if entry.dtype == torch.float8_e4m3fn:
            w_fp8, scale_inv = quantize_weight(value.float())
            scale_name = scale_spec(spec).name
            updates.setdefault(stored[scale_name].file, {})[scale_name] = scale_inv.cpu()
            updates.setdefault(entry.file, {})[spec.name] = w_fp8.cpu()
        else:
            updates.setdefault(entry.file, {})[spec.name] = value.to(entry.dtype).cpu()
    for file, new in updates.items():
        _rewrite_shard(path / file, new)
    return sum(len(new) for new in updates.values())


def _rewrite_shard(file: Path, new: dict[str, torch.Tensor]) -> None:
    with safe_open(file, framework="pt") as f:
        metadata = f.metadata() or {"format": "pt"}
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    tensors.update(new)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, file)
