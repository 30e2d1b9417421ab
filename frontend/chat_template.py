"""Chat messages -> prompt text through the checkpoint's chat template (`chat_template` in tokenizer_config.json),
rendered as transformers' `apply_chat_template` renders it, so that a prompt here equals the one a transformers
user gets: Jinja2's immutable sandbox with `trim_blocks` and `lstrip_blocks`, the loop-controls extension,
`raise_exception` (a template's own refusal, answered as a bad request), `strftime_now`, a `tojson` filter that
does not escape HTML, and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables.

Templates are untrusted code from a checkpoint: the sandbox keeps them from reaching Python internals."""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.model.errors import CheckpointError, InvalidRequestError

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


class ChatTemplate:
    """One checkpoint's chat template, compiled once."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source
        self.special_tokens = special_tokens
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(f"chat_template: not a valid Jinja2 template ({e})") from e

    @classmethod
    def load(cls, model_dir: Path) -> ChatTemplate | None:
        """The template of tokenizer_config.json (the one named `default` when it lists several), or None."""
        path = model_dir / "tokenizer_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        special = {name: _token_text(config.get(name)) for name in _SPECIAL_TOKENS}
        return cls(source, {k: v for k, v in special.items() if v is not None})

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`; a template that refuses them (`raise_exception`, a sandbox
        violation, a type error in the template) raises InvalidRequestError naming `messages`."""
        variables = {**(extra or {}), **self.special_tokens}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError("messages", f"the chat template refused them: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise InvalidRequestError(
                "messages", f"the chat template failed on them: {type(e).__name__}: {e}"
            ) from e
