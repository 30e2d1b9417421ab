"""A generation's text as it streams, for every front end alike: generated ids -> text deltas, and stop strings
matched in that text across token boundaries.

Deltas concatenate to the whole output's decode (bytes of an unfinished character are held until it completes,
and whatever is left is given at the end). With stop strings, a delta is also held back while it ends in the
beginning of one of them, so a stop string is never shown: the text ends just before the first one found."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer


def _longest_partial(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `stops`."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class TextStream:
    """Feed it each chunk's ids with `push`; call `finish` once when the generation ends by itself."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ):  # fmt: skip
        """skip_special_tokens: the text leaves out special tokens (BOS, EOS, padding)."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._incremental = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._decoded = 0
        """Characters the incremental detokenizer has given so far."""
        self._held = ""

    def push(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """The text to show for these ids, and whether a stop string ended the text here."""
        self._ids.extend(token_ids)
        delta = self._incremental.push(token_ids)
        self._decoded += len(delta)
        return self._release(delta)

    def finish(self) -> tuple[str, bool]:
        """The text still held back at the natural end (a stop string may yet complete in it)."""
        whole = self._tokenizer.decode(self._ids, self._skip)
        rest = whole[self._decoded :] if len(whole) > self._decoded else ""
        self._decoded = len(whole)
        text, stopped = self._release(rest)
        if not stopped:
            text, self._held = text + self._held, ""
        return text, stopped

    def _release(self, delta: str) -> tuple[str, bool]:
        if not self._stop:
            return delta, False
        text, self._held = self._held + delta, ""
        found = [at for at in (text.find(s) for s in self._stop) if at >= 0]
        if found:
            return text[: min(found)], True
        keep = _longest_partial(text, self._stop)
        if keep:
            text, self._held = text[:-keep], text[-keep:]
        return text, False
