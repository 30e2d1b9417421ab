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
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
CHAT_TOKENS = (USER_TOKEN, ASSISTANT_TOKEN, THINK_START, THINK_END)
"""Added (not special) tokens of DeepSeek-R1's chat format: decoded text keeps them, as R1's tokenizer does."""
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_TOKENS = (
    TOOL_CALLS_BEGIN, TOOL_CALL_BEGIN, TOOL_SEP, TOOL_CALL_END, TOOL_CALLS_END,
    TOOL_OUTPUTS_BEGIN, TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END, TOOL_OUTPUTS_END,
)  # fmt: skip
"""DeepSeek-V3's tool-call and tool-output markers, added (not special) tokens as in its tokenizer: decoded
text keeps them, so a tool-call parser reads them there."""

CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='', is_tool=false) -%}"
    "{%- for message in messages if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + ('\n\n' if ns.system else '') + message['content'] -%}"
    "{%- endfor -%}"
    "{{- bos_token + ns.system -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- set ns.is_tool = false -%}"
    "{{- '" + USER_TOKEN + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- if not ns.is_tool -%}"
    "{{- '" + ASSISTANT_TOKEN + THINK_END + "' -}}"
    "{%- endif -%}"
    "{%- set ns.is_tool = false -%}"
    "{%- set content = message['content'] or '' -%}"
    "{%- if '" + THINK_END + "' in content -%}"
    "{%- set content = content.split('" + THINK_END + "')[-1] -%}"
    "{%- endif -%}"
    "{{- content -}}"
    "{%- if message['tool_calls'] -%}"
    "{{- '" + TOOL_CALLS_BEGIN + "' -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{{- '" + TOOL_CALL_BEGIN + "' + call['function']['name'] + '" + TOOL_SEP + "' -}}"
    "{{- call['function']['arguments'] + '" + TOOL_CALL_END + "' -}}"
    "{%- endfor -%}"
    "{{- '" + TOOL_CALLS_END + "' -}}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- set ns.is_tool = true -%}"
    "{{- '" + TOOL_OUTPUT_BEGIN + "' + message['content'] + '" + TOOL_OUTPUT_END + "' -}}"
    "{%- elif message['role'] != 'system' -%}"
    "{{- raise_exception('roles must be system, user, assistant or tool, got ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and not ns.is_tool and thinking is defined and thinking -%}"
    "{{- '" + ASSISTANT_TOKEN + THINK_START + "' -}}"
    "{%- elif add_generation_prompt and not ns.is_tool -%}"
    "{{- '" + ASSISTANT_TOKEN + THINK_END + "' -}}"
    "{%- endif -%}"
)
"""A chat template of DeepSeek-V3.1's hybrid shape for checkpoints made here: system prompts first after BOS,
user and assistant turns marked by their tokens, earlier answers stripped of their reasoning, and a generation
prompt that closes the think block (`<｜Assistant｜></think>`: the answer comes at once) unless the request
passes `chat_template_kwargs: {"thinking": true}`, which opens it (`<｜Assistant｜><think>`: reasoning up to
`</think>`, then the answer). Non-thinking by default, so that a random model, which seldom closes a think
block, answers in `content`.

Tools as V3.1 renders them: an assistant turn's `tool_calls` as
`<｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>)+<｜tool▁calls▁end｜>`
after its content, each `tool` message as `<｜tool▁output▁begin｜>CONTENT<｜tool▁output▁end｜>`, and after tool
results no new assistant marker (the answer continues from them). Like V3.1's own template it does not render
the request's `tools`: the front end describes them in a system message (`frontend.tool_format`)."""


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

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """`add_bos=False` for text that carries its own BOS (a rendered chat template)."""
        # encode_batch releases the GIL while it tokenizes (encode holds it throughout), so a long text
        # tokenized in a worker thread does not stall the caller's event loop.
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_bos and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str | None:
        """The vocabulary's entry for `token_id` (byte-level pieces as the vocabulary spells them), or None."""
        return self._tok.id_to_token(token_id)

    def token_id(self, token: str) -> int | None:
        """The id of one token of the vocabulary (e.g. `</think>`), None if it has none."""
        return self._tok.token_to_id(token)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas. A delta is held back while it ends in an incomplete
    UTF-8 sequence (U+FFFD), so multi-byte characters split across tokens are never emitted broken."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-4:])
        self._prefix = 0
        self._read = len(self._ids)
        self._skip = skip_special_tokens

    def push(self, new_ids: Sequence[int]) -> str:
        """Adds ids; returns the text they complete (possibly empty)."""
        self._ids.extend(new_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]


def build_tokenizer(out_dir: str | Path, vocab_size: int, model_max_length: int) -> None:
    """Trains a byte-level BPE on a short built-in text and writes tokenizer.json + tokenizer_config.json with
    DeepSeek-R1's chat tokens and V3's tool tokens (`CHAT_TOKENS`, `TOOL_TOKENS`: the last ids) and a chat
    template of V3.1's shape; at most `vocab_size` tokens in all. Ids 0, 1, 2 are BOS, EOS, PAD (as in DeepSeek-V3)."""
    out_dir = Path(out_dir)
    corpus = resources.files("pdserve.model").joinpath("data/corpus.txt").read_text()
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CHAT_TOKENS) - len(TOOL_TOKENS),
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    added = (*CHAT_TOKENS, *TOOL_TOKENS)
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in added])
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
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
