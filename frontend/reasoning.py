"""Splits a reasoning model's generated text into its reasoning (inside `<think>...</think>`) and its content (the
rest). Where the prompt opened the think block (DeepSeek-R1's chat template does; DeepSeek-V3.1's does when asked
to think), the output is reasoning up to `</think>` and content after it, as vLLM's `--reasoning-parser
deepseek_r1` splits it (an output that opens the block itself has that `<think>` dropped; one that never closes
it is all reasoning). Where the prompt did not open one (V3.1's non-thinking mode), the output is content, as
vLLM's `deepseek_v3` parser answers a request that does not think, unless the output itself opens with a think
block: then that block is reasoning.

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


def prompt_opens_think(text: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """Whether prompt `text` ends inside a think block: its last think tag opens one."""
    return text.rfind(start) > text.rfind(end)


class ReasoningSplitter:
    """Feed it text pieces with `push`, then `flush` once at the end; each returns (reasoning, content).
    in_think: the prompt left the output inside a think block (`prompt_opens_think`)."""

    def __init__(self, in_think: bool = True, start: str = THINK_START, end: str = THINK_END):
        self._start, self._end = start, end
        self._in_think = in_think
        self._state = _START
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        if self._state == _START:
            if len(buf) < len(self._start) and self._start.startswith(buf):
                self._held = buf
                return "", ""
            opened = buf.startswith(self._start)
            if opened:
                buf = buf[len(self._start) :]
            self._state = _REASONING if opened or self._in_think else _CONTENT
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
        if self._state == _START:  # the whole output was a beginning of `<think>`
            return ("", held) if not self._in_think else (held, "")
        return ("", held) if self._state == _CONTENT else (held, "")


def split_reasoning(text: str, in_think: bool = True) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    splitter = ReasoningSplitter(in_think)
    reasoning, content = splitter.push(text)
    more_reasoning, more_content = splitter.flush()
    return reasoning + more_reasoning, content + more_content
