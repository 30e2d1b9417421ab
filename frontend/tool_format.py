"""DeepSeek-V3's tool-call formats as a checkpoint's chat template writes them: which one a template uses, the
text of a call in it, how a request's tools are described to the model, and the text that makes the model call
(appended to the generation prompt for `tool_choice: required` or a named function).

Two formats, told apart by the template (its assistant turns write earlier calls the way the model writes them):

- `deepseek_v3` (DeepSeek-V3, V3-0324, R1): calls, one per line, each typed and fenced:
  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + "\\n```json\\n" + `ARGS` + "\\n```" +
  `<｜tool▁call▁end｜>` (+ "\\n" + more calls) + `<｜tool▁calls▁end｜>`;
- `deepseek_v31` (DeepSeek-V3.1): calls chained without separators:
  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.

The checkpoints' own templates render earlier calls and tool results but not the request's `tools`: DeepSeek's
model cards describe them in the system prompt, in the text `describe` writes. A template that does use a
`tools` variable (as vLLM's example templates do) is given them instead."""

from __future__ import annotations

import dataclasses
import functools
import json

import jinja2.meta

from pdserve.model.tokenizer import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)

_FENCE_OPEN = "\n```json\n"
_FENCE_CLOSE = "\n```"
_CALL_TYPE = "function"


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One way of writing tool calls."""

    name: str
    typed: bool
    """DeepSeek-V3's: a call names its type before the separator and fences its arguments as a JSON block."""

    def call_head(self, function: str | None = None) -> str:
        """The text of a call up to where its arguments begin; `function` None: up to where its name begins."""
        head = TOOL_CALL_BEGIN + (_CALL_TYPE + TOOL_SEP if self.typed else "")
        if function is None:
            return head
        return head + function + (_FENCE_OPEN if self.typed else TOOL_SEP)

    def call_tail(self) -> str:
        """The text that ends a call's arguments."""
        return (_FENCE_CLOSE if self.typed else "") + TOOL_CALL_END

    def call_text(self, function: str, arguments: str) -> str:
        """One whole call, as the model writes it."""
        return self.call_head(function) + arguments + self.call_tail()

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """A whole block of (name, arguments) calls, as the model writes it."""
        joiner = "\n" if self.typed else ""
        body = joiner.join(self.call_text(name, args) for name, args in calls)
        return TOOL_CALLS_BEGIN + body + TOOL_CALLS_END

    def forced_prefix(self, function: str | None) -> str:
        """What the generation prompt is extended by so that the output is a call: of `function`, or (None)
        of a function the model names."""
        return TOOL_CALLS_BEGIN + self.call_head(function)

    def describe(self, tools: list[dict]) -> str:
        """The system prompt's description of `tools` (OpenAI's `{"type": "function", "function": {...}}`
        entries), in the shape DeepSeek's model cards give, with this format's call shape."""
        lines = ["## Tools", "You have access to the following tools:", ""]
        for tool in tools:
            function = tool["function"]
            lines += [
                f"### {function['name']}",
                f"Description: {function.get('description', '')}",
                "",
            ]
            parameters = function.get("parameters", {"type": "object", "properties": {}})
            lines += [f"Parameters: {json.dumps(parameters)}", ""]
        example = self.calls_text([("tool_call_name", "tool_call_arguments")])
        example = example.replace(TOOL_CALLS_END, "{{additional_tool_calls}}" + TOOL_CALLS_END)
        separator = "each on a new line" if self.typed else "directly without separators or spaces"
        lines += [
            "IMPORTANT: ALWAYS adhere to this exact format for tool use:",
            example,
            "",
            "Where:",
            "",
            "- `tool_call_name` must be an exact match to one of the available tools",
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema",
            f"- For multiple tool calls, chain them {separator}",
        ]
        return "\n".join(lines) + "\n"


DEEPSEEK_V3 = ToolCallFormat("deepseek_v3", typed=True)
DEEPSEEK_V31 = ToolCallFormat("deepseek_v31", typed=False)


def detect_format(template_source: str) -> ToolCallFormat | None:
    """The format a chat template writes earlier tool calls in; None for a template that writes none."""
    if TOOL_CALLS_BEGIN not in template_source or TOOL_SEP not in template_source:
        return None
    return DEEPSEEK_V3 if "```json" in template_source else DEEPSEEK_V31


@functools.lru_cache(maxsize=16)
def renders_tools(template_source: str) -> bool:
    """Whether a chat template reads a `tools` variable (else the tools go into a system message)."""
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template_source))
    except jinja2.TemplateSyntaxError:
        return False


def with_tools_described(
    messages: list[dict], fmt: ToolCallFormat, tools: list[dict]
) -> list[dict]:
    """`messages` with a system message describing `tools` after the leading system messages (DeepSeek's
    templates join every system message, in order, into the system prompt)."""
    at = 0
    while at < len(messages) and messages[at].get("role") == "system":
        at += 1
    described = {"role": "system", "content": fmt.describe(tools)}
    return [*messages[:at], described, *messages[at:]]
