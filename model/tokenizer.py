"""Tokenizer: a checkpoint's tokenizer.json through HF `tokenizers`, incremental detokenization for streaming, and
a small byte-level BPE built locally (no hub) for random checkpoints."""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from .errors import CheckpointError

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"


class Tokenizer:
    """Encodes prompts (with BOS when tokenizer_config.json says so) and decodes generated ids."""

    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(
                f"{file}: missing (needed for text prompts; use token ids instead)"
            )
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:
            raise CheckpointError(f"{file}: cannot load ({e})") from e
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.add_bos = bool(config.get("add_bos_token", True))
        self.bos_id = self._special_id(config.get("bos_token"), BOS_TOKEN)
        self.eos_id = self._special_id(config.get("eos_token"), EOS_TOKEN)

    def _special_id(self, token: str | dict | None, default: str) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token or default)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas. A delta is held back while it ends in an incomplete
    UTF-8 sequence (U+FFFD), so multi-byte characters split across tokens are never emitted broken."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-4:])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, new_ids: Sequence[int]) -> str:
        """Adds ids; returns the text they complete (possibly empty)."""
        self._ids.extend(new_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full_text = self._tok.decode(self._ids[self._prefix :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]


def build_tokenizer(out_dir: str | Path, vocab_size: int, model_max_length: int) -> None:
    """Trains a byte-level BPE of at most `vocab_size` tokens on a short built-in text and writes
    tokenizer.json + tokenizer_config.json. Ids 0, 1, 2 are BOS, EOS, PAD (as in DeepSeek-V3)."""
    out_dir = Path(out_dir)
    corpus = resources.files("pdserve.model").joinpath("data/corpus.txt").read_text()
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
