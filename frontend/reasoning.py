"""Splits a reasoning model's generated text into its reasoning (inside `<think>...</think>`) and its content (the
rest), as vLLM's `--reasoning-parser deepseek_r1` does: DeepSeek-R1's chat template opens the think block in the
prompt, so the output is reasoning up to `</think>` and content after it (an output that opens the block itself
has that `<think>` dropped; one that never closes it is all reasoning).

Text arrives in pieces while streaming: a piece that ends in part of a think tag is held back until the tag is
known, so tags are never shown and a stream splits exactly as the whole text does."""

from __future__ import annotations

from pdserve.model.tokenizer import THINK_END, THINK_START

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (and is shorter than it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Feed it text pieces with `push`, then `flush` once at the end; each returns (reasoning, content)."""

    def __init__(self, start: str = THINK_START, end: str = THINK_END):
        self._start, self._end = start, end
        self._state = _START
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        if self._state == _START:
            if len(buf) < len(self._start) and self._start.startswith(buf):
                self._held = buf
                return "", ""
            if buf.startswith(self._start):
                buf = buf[len(self._start) :]
            self._state = _REASONING
        if self._state == _CONTENT:
            return "", buf
        at = buf.find(self._end)
        if at >= 0:
            self._state = _CONTENT
            return buf[:at], buf[at + len(self._end) :]
        keep = _partial_suffix(buf, self._end)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], ""

    def flush(self) -> tuple[str, str]:
        """What was held back, once no more text comes."""
        held, self._held = self._held, ""
        return ("", held) if self._state == _CONTENT else (held, "")


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    splitter = ReasoningSplitter()
    reasoning, content = splitter.push(text)
    more_reasoning, more_content = splitter.flush()
    return reasoning + more_reasoning, content + more_content
