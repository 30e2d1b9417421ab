"""The OpenAI parameters the HTTP front end accepts and ignores, as vLLM ignores them, and how it says so: a
WARNING in the log the first time this process ignores each name, and a response header naming every
parameter the request gave and the server ignored (`IGNORED_HEADER`). `openai_api.parse` lists them."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def _is_str(value) -> bool:
    return isinstance(value, str)


def _is_bool(value) -> bool:
    return isinstance(value, bool)


def _is_object(value) -> bool:
    return isinstance(value, dict)


IGNORED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (_is_bool, "true or false"),
    "metadata": (_is_object, "an object"),
    "service_tier": (_is_str, "a string"),
    "reasoning_effort": (_is_str, "a string"),
    "modalities": (lambda v: isinstance(v, list) and all(map(_is_str, v)), "a list of strings"),
    "prediction": (_is_object, "an object"),
    "verbosity": (_is_str, "a string"),
    "prompt_cache_key": (_is_str, "a string"),
    "safety_identifier": (_is_str, "a string"),
}
"""OpenAI parameters accepted and ignored, as vLLM ignores them (they ask for storage, billing tiers, caching
hints or output modes that change no token here), each with its type check: a value of the wrong type is
still refused naming it. Listed as ignored when given (not null)."""
IGNORED_STREAM_OPTIONS = frozenset({"include_obfuscation"})
"""`stream_options` keys accepted and ignored (obfuscation pads chunks against side channels; none here)."""

IGNORED_HEADER = "x-pdserve-ignored-fields"
"""The response header that names the parameters a request gave and the server ignored."""
_SHOWN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MAX_SHOWN = 32
_MAX_WARNED = 1024
"""Names warned about once each; past this many, no more warnings (a client sending made-up names must not
grow memory or flood the log)."""


def ignored_names(names: tuple[str, ...]) -> str:
    """`names` as the header and the log name them: comma-separated, those that are not plain short
    identifiers (any text a client may send as a key) and those past the first few counted instead."""
    shown = [n for n in names if _SHOWN_NAME.fullmatch(n)][:_MAX_SHOWN]
    rest = len(names) - len(shown)
    return ", ".join(shown + ([f"({rest} more)"] if rest else []))


class IgnoredFieldsLog:
    """One serving process's record of the names it has warned about."""

    def __init__(self):
        self._warned: set[str] = set()

    def headers(self, ignored: tuple[str, ...]) -> dict[str, str]:
        """The response headers for a request that gave `ignored` (none: no header); a WARNING naming those
        not warned about before."""
        if not ignored:
            return {}
        new = [n for n in dict.fromkeys(ignored) if n not in self._warned]
        if new and len(self._warned) < _MAX_WARNED:
            self._warned.update(new)
            logger.warning(
                "ignoring request parameters this server does not use: %s (warned once per name)",
                ignored_names(tuple(new)),
            )
        return {IGNORED_HEADER: ignored_names(ignored)}
