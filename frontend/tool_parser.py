"""Generated text -> OpenAI tool calls, in either DeepSeek format (`tool_format`), read as it streams.

One parser serves whole answers and streams alike (a whole answer is one `push` and a `finish`), so a stream's
deltas add up to the whole answer's calls in any chunking. What the parser decides depends only on the text so
far, never on what follows, and it holds back only what is still undecided:

- text before `<｜tool▁calls▁begin｜>` is content (a piece ending in part of that marker is held back);
- in the block, a call is accepted once its head is whole (`<｜tool▁call▁begin｜>`, the V3 format's type
  `function` and separator, the name, the separator or the V3 format's JSON fence) and names one of the
  request's functions: its first delta then carries index, id, type and name; its arguments follow as they
  arrive, up to `<｜tool▁call▁end｜>` (the V3 format's closing fence and the whitespace around it dropped);
- a block whose first call does not come out that way (a wrong marker, an unknown name, no separator within
  `MAX_HEAD_CHARS`, the output ending first) is content, markers and all, as is anything after a call that is
  not another call or `<｜tool▁calls▁end｜>`, and anything after the block;
- calls past `max_calls` (a named function, `parallel_tool_calls: false`) are dropped;
- an output that ends inside a call's arguments keeps the call, with the arguments so far.

Arguments are passed on as the model wrote them: whether they are valid JSON for the schema is the grammar
mask's guarantee (`tool_request.ToolCallConstraint`), not the parser's."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable

from pdserve.frontend.tool_format import ToolCallFormat
from pdserve.model.tokenizer import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)

MAX_HEAD_CHARS = 256
"""Characters a call's head may take (OpenAI's names have at most 64) before the block counts as malformed."""
_CALL_TYPE = "function"
_FENCE = "```json\n"
_BLANKS = " \t\r\n"

_CONTENT, _BETWEEN, _HEAD, _ARGS, _DROP, _AFTER = (
    "content",
    "between",
    "head",
    "args",
    "drop",
    "after",
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (and is shorter than it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@dataclasses.dataclass(slots=True)
class ToolCall:
    """A parsed call; its arguments kept in the pieces they came in (joined once, not at every piece)."""

    id: str
    name: str
    pieces: list[str] = dataclasses.field(default_factory=list)

    @property
    def arguments(self) -> str:
        return "".join(self.pieces)

    def openai(self) -> dict:
        """OpenAI's shape of the call in a message."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolCallParser:
    """Feed it text with `push`, then `finish` once; each returns (content, tool-call deltas), the deltas in
    OpenAI's `delta.tool_calls` shape (one entry per call touched, in index order). `calls` holds the calls so
    far. `primed`: text the prompt ended in (a forced call's start), read first without becoming content."""

    def __init__(
        self, fmt: ToolCallFormat, names: frozenset[str], primed: str = "",
        max_calls: int | None = None, call_id: Callable[[], str] = new_call_id,
    ):  # fmt: skip
        self._fmt, self._names, self._max_calls, self._call_id = fmt, names, max_calls, call_id
        self._state = _CONTENT
        self._held = ""
        """Text read and not yet decided."""
        self._block = ""
        """The generated text of the block read so far (content again if its first call fails)."""
        self._unsent = ""
        """The end of the open call's arguments not sent yet: what may be the V3 format's closing fence."""
        self.calls: list[ToolCall] = []
        self._deltas: dict[int, dict] = {}
        self._primed, self._primed_held = True, ""
        if primed:
            content = self._read(primed)
            assert not content, "a forced prefix is a call block's start"
        self._primed = False
        self._primed_held = self._held
        """The end of the forced prefix still undecided (the V3 format's head): never given as content."""

    # The interface.

    def push(self, text: str) -> tuple[str, list[dict]]:
        content = self._read(text)
        return content, self._take_deltas()

    def finish(self) -> tuple[str, list[dict]]:
        """What was held back, once no more text comes."""
        held, self._held = self._held, ""
        content = ""
        if self._state == _CONTENT:
            content = held
        elif self._state == _ARGS:
            self._send_arguments(held, final=True)
        elif self._state == _HEAD or (self._state == _BETWEEN and (held.strip() or not self.calls)):
            content = self._fail(held)
        self._state = _AFTER
        return content, self._take_deltas()

    # The machine.

    def _read(self, text: str) -> str:
        buf, self._held = self._held + text, ""
        out = []
        while buf:
            before = self._state
            used, content = getattr(self, f"_in_{before}")(buf)
            out.append(content)
            if used == 0:  # undecided: hold the rest
                self._held = buf
                break
            if before in (_BETWEEN, _HEAD) and self._state != _AFTER and not self._primed:
                self._block += buf[:used]
            buf = buf[used:]
        return "".join(out)

    def _in_content(self, buf: str) -> tuple[int, str]:
        at = buf.find(TOOL_CALLS_BEGIN)
        if at >= 0:
            self._state, self._block = _BETWEEN, ("" if self._primed else TOOL_CALLS_BEGIN)
            return at + len(TOOL_CALLS_BEGIN), buf[:at]
        keep = _partial_suffix(buf, TOOL_CALLS_BEGIN)
        if keep == len(buf):
            return 0, ""
        return len(buf) - keep, buf[: len(buf) - keep]

    def _in_after(self, buf: str) -> tuple[int, str]:
        return len(buf), buf

    def _in_between(self, buf: str) -> tuple[int, str]:
        rest = buf.lstrip(_BLANKS)
        skipped = len(buf) - len(rest)
        for marker, state in ((TOOL_CALL_BEGIN, _HEAD), (TOOL_CALLS_END, _AFTER)):
            if rest.startswith(marker):
                if state == _HEAD and self._max_calls is not None:
                    state = _HEAD if len(self.calls) < self._max_calls else _DROP
                self._state = state
                return skipped + len(marker), ""
        if not rest or TOOL_CALL_BEGIN.startswith(rest) or TOOL_CALLS_END.startswith(rest):
            return 0, ""
        return len(buf), self._fail(buf)

    def _in_head(self, buf: str) -> tuple[int, str]:
        at = buf.find(TOOL_SEP)
        if at < 0:
            if len(buf) > MAX_HEAD_CHARS or TOOL_CALL_END in buf or TOOL_CALLS_END in buf:
                return len(buf), self._fail(buf)
            return 0, ""
        if not self._fmt.typed:
            return self._open(buf[:at], at + len(TOOL_SEP), buf)
        if buf[:at].strip() != _CALL_TYPE:
            return len(buf), self._fail(buf)
        after = at + len(TOOL_SEP)
        newline = buf.find("\n", after)
        if newline < 0:
            if len(buf) > MAX_HEAD_CHARS:
                return len(buf), self._fail(buf)
            return 0, ""
        fence = buf[newline + 1 :]
        if len(fence) < len(_FENCE) and _FENCE.startswith(fence):
            return 0, ""  # the fence may yet come
        start = newline + 1 + (len(_FENCE) if fence.startswith(_FENCE) else 0)
        return self._open(buf[after:newline], start, buf)

    def _open(self, name: str, used: int, buf: str) -> tuple[int, str]:
        name = name.strip()
        if name not in self._names:
            return len(buf), self._fail(buf)
        call = ToolCall(self._call_id(), name)
        self.calls.append(call)
        self._delta()["id"] = call.id
        self._delta()["type"] = "function"
        self._delta()["function"]["name"] = name
        self._state, self._unsent = _ARGS, ""
        return used, ""

    def _in_args(self, buf: str) -> tuple[int, str]:
        at = buf.find(TOOL_CALL_END)
        if at >= 0:
            self._send_arguments(buf[:at], final=True)
            self._state = _BETWEEN
            return at + len(TOOL_CALL_END), ""
        keep = _partial_suffix(buf, TOOL_CALL_END)
        self._send_arguments(buf[: len(buf) - keep], final=False)
        return (0, "") if keep == len(buf) else (len(buf) - keep, "")

    def _in_drop(self, buf: str) -> tuple[int, str]:
        at = buf.find(TOOL_CALLS_END)
        if at >= 0:
            self._state = _AFTER
            return at + len(TOOL_CALLS_END), ""
        keep = _partial_suffix(buf, TOOL_CALLS_END)
        return (0, "") if keep == len(buf) else (len(buf) - keep, "")

    def _fail(self, rest: str) -> str:
        """The block does not parse from here: the content to give (the whole block's text if no call came
        out of it, else `rest`); everything after is content."""
        self._state = _AFTER
        if self.calls:
            return rest
        return self._block + rest.removeprefix(self._primed_held)

    # Arguments.

    def _send_arguments(self, text: str, final: bool) -> None:
        """Sends what `text` adds to the open call's arguments as far as it is known: what follows cannot
        change what was sent. The V3 format's arguments end before the closing fence and the blanks around
        it, so a trailing run of blanks and backticks waits (what was sent ends in neither)."""
        text, self._unsent = self._unsent + text, ""
        if self._fmt.typed and final:
            text = text.rstrip(_BLANKS).removesuffix("```").rstrip(_BLANKS)
        elif self._fmt.typed:
            known = text.rstrip(_BLANKS + "`")
            text, self._unsent = known, text[len(known) :]
        if text:
            self.calls[-1].pieces.append(text)
            function = self._delta()["function"]
            function["arguments"] = function.get("arguments", "") + text

    def _delta(self) -> dict:
        index = len(self.calls) - 1
        return self._deltas.setdefault(index, {"index": index, "function": {}})

    def _take_deltas(self) -> list[dict]:
        deltas = [self._deltas[i] for i in sorted(self._deltas)]
        self._deltas = {}
        for (
            delta
        ) in deltas:  # a call's first delta names it with its arguments so far ("" if none yet)
            if "id" in delta:
                delta["function"].setdefault("arguments", "")
        return deltas
