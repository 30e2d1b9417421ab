"""One chat choice's generated text -> what the chat API answers: reasoning split off first
(`reasoning.ReasoningSplitter`, where the model thinks), tool calls parsed out of the rest
(`tool_parser.ToolCallParser`, where the request has tools), the remainder content. A whole answer and a stream
go through the same pieces, so a stream's deltas add up to the whole answer."""

from __future__ import annotations

from pdserve.engine.sampling_params import FinishReason
from pdserve.frontend.openai_api import chat_message
from pdserve.frontend.reasoning import ReasoningSplitter
from pdserve.frontend.request_builder import CheckedRequest
from pdserve.frontend.tool_parser import ToolCallParser

TOOL_CALLS = "tool_calls"
"""OpenAI's finish reason of an answer that ends in tool calls."""


class ChatOutput:
    """Feed it a choice's text with `push`; `last` once, with the last piece. reasoning: None, no reasoning
    split; else whether the output starts inside a think block."""

    def __init__(self, request: CheckedRequest, reasoning: bool | None):
        self._splitter = None if reasoning is None else ReasoningSplitter(reasoning)
        plan = request.tool_calls
        self._parser = None
        if plan is not None:
            self._parser = ToolCallParser(
                plan.format, plan.names, plan.forced_prefix, plan.max_calls
            )
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def push(self, text: str, last: bool) -> dict:
        """The stream's delta for `text` (empty: nothing to send)."""
        if self._splitter is None:
            thought, content = "", text
        else:
            thought, content = self._splitter.push(text)
            if last:
                more_thought, more_content = self._splitter.flush()
                thought, content = thought + more_thought, content + more_content
        calls: list[dict] = []
        if self._parser is not None:
            content, calls = self._parser.push(content)
            if last:
                more_content, more_calls = self._parser.finish()
                content, calls = content + more_content, _merge(calls + more_calls)
        self._reasoning.append(thought)
        self._content.append(content)
        body: dict = {}
        if thought:
            body["reasoning_content"] = body["reasoning"] = thought
        if content:
            body["content"] = content
        if calls:
            body["tool_calls"] = calls
        return body

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish reason for the engine's: `tool_calls` for an output that stopped by itself after
        making calls."""
        made = self._parser is not None and self._parser.calls
        return TOOL_CALLS if made and reason == FinishReason.STOP else reason

    def message(self) -> dict:
        """The whole answer's message, once the last piece was pushed."""
        reasoning = None if self._splitter is None else "".join(self._reasoning)
        calls = None if self._parser is None else [c.openai() for c in self._parser.calls]
        return chat_message("".join(self._content), reasoning, calls)


def _merge(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas of one chunk, one per call (a call's later arguments joined to its first delta)."""
    merged: dict[int, dict] = {}
    for delta in deltas:
        into = merged.get(delta["index"])
        if into is None:
            merged[delta["index"]] = {**delta, "function": dict(delta["function"])}
            continue
        function = into["function"]
        function["arguments"] = function.get("arguments", "") + delta["function"].get(
            "arguments", ""
        )
        for key in ("id", "type"):
            if key in delta:
                into[key] = delta[key]
        if "name" in delta["function"]:
            function["name"] = delta["function"]["name"]
    return [merged[i] for i in sorted(merged)]
