"""A chat request's tools: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` checked (`parse_tools`), the
calls and results of earlier turns checked (`message_tool_calls`), and, against the served checkpoint's chat
template, the plan a request is built and answered by (`plan_tools`): how the prompt describes the tools, what
it is extended by to force a call, how the output is parsed, and the constraint a grammar mask enforces.

`tool_choice`: `none` renders and parses no tools (as if none were given); `auto` (the default with tools)
describes them and parses calls where the output writes them; `required` and a named function also extend the
generation prompt with the start of a call block (`ToolCallFormat.forced_prefix`), naming the function where one
is named, so the output starts inside a call. Without a grammar mask the arguments the model then writes are
whatever it writes: `ToolCallConstraint` (on `CheckedRequest.tool_calls.constraint`) states what the mask must
enforce from there."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from pdserve.frontend.chat_template import ChatTemplate
from pdserve.frontend.tool_format import (
    ToolCallFormat,
    detect_format,
    renders_tools,
    with_tools_described,
)
from pdserve.model.errors import InvalidRequestError

NONE, AUTO, REQUIRED = "none", "auto", "required"
_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")
"""OpenAI's rule for a function's name."""
_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
MAX_TOOLS = 128
"""OpenAI's limit on the functions one request may list."""


@dataclasses.dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's checked tools."""

    tools: tuple[dict[str, Any], ...]
    """OpenAI's entries, normalized: `{"type": "function", "function": {"name", "description"?,
    "parameters", "strict"?}}`, `parameters` defaulted to an empty object schema."""
    choice: str
    """NONE, AUTO, REQUIRED, or the name of the function the output must call."""
    parallel: bool = True
    """The output may make several calls (OpenAI's `parallel_tool_calls`)."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    def schema(self, name: str) -> dict[str, Any]:
        """The JSON schema of function `name`'s arguments."""
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"]["parameters"]
        raise KeyError(name)


def _check_schema(schema: Any, where: str) -> None:
    """A light check of a JSON schema's shape: objects where the schema keywords need them, known type names.
    (A grammar mask compiles it fully; this refuses what could not be a schema at all.)"""
    if not isinstance(schema, dict):
        raise InvalidRequestError(where, f"expected a JSON schema object, got {schema!r:.80}")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in _SCHEMA_TYPES for k in kinds):
        raise InvalidRequestError(f"{where}.type", f"not a JSON schema type: {kind!r:.80}")
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            raise InvalidRequestError(f"{where}.properties", "expected an object of schemas")
        for key, sub in properties.items():
            _check_schema(sub, f"{where}.properties.{key}")
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        raise InvalidRequestError(f"{where}.required", "expected a list of property names")
    items = schema.get("items")
    if isinstance(items, dict):
        _check_schema(items, f"{where}.items")


def _tool(entry: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict) or entry.get("type") != "function":
        raise InvalidRequestError(where, "expected {'type': 'function', 'function': {...}}")
    function = entry.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where}.function", "expected an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(
            f"{where}.function.name", f"expected 1-64 of a-z, A-Z, 0-9, _ and -, got {name!r:.80}"
        )
    out: dict[str, Any] = {"name": name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.description", "expected a string")
        out["description"] = description
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    _check_schema(parameters, f"{where}.function.parameters")
    out["parameters"] = parameters
    strict = function.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise InvalidRequestError(f"{where}.function.strict", "expected true or false")
        out["strict"] = strict
    return {"type": "function", "function": out}


def parse_tools(body: dict) -> ToolRequest | None:
    """The tools of a chat request's body; None where it gives none or `tool_choice: none`. Every refusal
    names the field: a malformed tool or schema, a duplicate name, `tool_choice` without tools or naming
    a function not listed."""
    given = body.get("tools")
    if given is not None and not isinstance(given, list):
        raise InvalidRequestError("tools", "expected a list of tools")
    if given and len(given) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"{len(given)} tools; at most {MAX_TOOLS}")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(given or ()))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise InvalidRequestError(f"tools[{i}].function.name", f"{name!r} is listed twice")
        seen.add(name)
    choice = _choice(body.get("tool_choice"), seen)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError(
            "parallel_tool_calls", f"expected true or false, got {parallel!r:.80}"
        )
    if choice == NONE or not tools:
        return None
    return ToolRequest(tools, choice, True if parallel is None else parallel)


def _choice(value: Any, names: set[str]) -> str:
    if value is None:
        return AUTO if names else NONE
    if isinstance(value, str):
        if value not in (NONE, AUTO, REQUIRED):
            raise InvalidRequestError(
                "tool_choice", f"expected none, auto, required or a function, got {value!r:.80}"
            )
        if value != NONE and not names:
            raise InvalidRequestError(
                "tool_choice", f"{value!r} needs tools: the request lists none"
            )
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or value.get("type") != "function"
        or not isinstance(function, dict)
    ):
        raise InvalidRequestError(
            "tool_choice",
            "expected none, auto, required or {'type': 'function', 'function': {'name': ...}}",
        )
    name = function.get("name")
    if not isinstance(name, str):
        raise InvalidRequestError("tool_choice.function.name", "expected a string")
    if name not in names:
        listed = ", ".join(sorted(names)) or "none"
        raise InvalidRequestError(
            "tool_choice.function.name",
            f"{name!r:.80} is not one of the tools (listed: {listed:.200})",
        )
    return name


def message_tool_fields(message: dict[str, Any], where: str) -> dict[str, Any]:
    """What chat message `message` (at `where`) has of tools, checked, for a chat template: an assistant's
    `tool_calls` (`message_tool_calls`; `content` null where no text comes before them, as templates test it),
    a tool result's `tool_call_id`."""
    fields: dict[str, Any] = {}
    if message.get("tool_calls"):
        if message["role"] != "assistant":
            raise InvalidRequestError(
                f"{where}.tool_calls", "only assistant messages make tool calls"
            )
        fields["tool_calls"] = message_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if not message.get("content"):
            fields["content"] = None
    if message["role"] == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequestError(f"{where}.tool_call_id", "expected a string")
        fields["tool_call_id"] = call_id or ""
    return fields


def message_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier `tool_calls`, checked and normalized for a chat template: each
    `{"id", "type": "function", "function": {"name", "arguments"}}` with `arguments` a JSON string (an object
    given instead is written as JSON)."""
    if not isinstance(calls, list):
        raise InvalidRequestError(where, "expected a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise InvalidRequestError(at, "expected {'type': 'function', 'function': {...}}")
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{at}.function.name", "expected a function's name")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise InvalidRequestError(f"{at}.function.arguments", "expected a JSON string")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequestError(f"{at}.id", "expected a string")
        out.append(
            {
                "id": call_id or f"call_{i}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallConstraint:
    """What a grammar mask enforces on a request's output so that its tool calls parse: the one place where a
    structured-output engine hooks tool calling. Built by `plan_tools`; found on `CheckedRequest.tool_calls`.

    Where `forced` (tool_choice required or named), the prompt already ends in `ToolCallPlan.forced_prefix`,
    so the output starts inside the call block (or, where the prompt opened a think block, the output writes
    the whole block, forced prefix included, once its reasoning ends); it must then be, in `format`:
      named:    ARGS(named) format.call_tail() [more calls, if max_calls allows] TOOL_CALLS_END
      required: NAME format's separator ARGS(NAME) format.call_tail() ... TOOL_CALLS_END, NAME in `schemas`
    where ARGS(name) is JSON valid against `schemas[name]` and each further call is
    `format.call_head(NAME) ARGS(NAME) format.call_tail()` (with "\\n" before it in the V3 format). Where not
    forced (auto) the same grammar applies from the point the output writes TOOL_CALLS_BEGIN, if it does."""

    format: ToolCallFormat
    schemas: dict[str, dict[str, Any]]
    """Function name -> its arguments' JSON schema: the functions a call may name."""
    forced: bool
    named: str | None
    """The one function a call may name (tool_choice named), else None."""
    max_calls: int | None
    """1 for a named function or `parallel_tool_calls: false`; None: no limit."""

    def arguments_schema(self, name: str) -> dict[str, Any]:
        return self.schemas[name]


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallPlan:
    """How one request's tool calls are prompted for and parsed."""

    format: ToolCallFormat
    names: frozenset[str]
    """The functions a parsed call may name (the named one alone for a named tool_choice)."""
    forced_prefix: str
    """Text the generation prompt is extended by ("": none, and for a forced call after a think block the
    prompt opened: the output writes it); the parser reads it before the output."""
    max_calls: int | None
    constraint: ToolCallConstraint


def plan_tools(tools: ToolRequest, template: ChatTemplate) -> ToolCallPlan:
    """The plan for `tools` on a checkpoint whose chat template is `template`; InvalidRequestError naming
    `tools` where the template writes no tool calls."""
    fmt = detect_format(template.source)
    if fmt is None:
        raise InvalidRequestError(
            "tools", "this model's chat template has no tool-call format (DeepSeek-V3's or V3.1's)"
        )
    named = tools.choice if tools.choice not in (AUTO, REQUIRED) else None
    forced = tools.choice != AUTO
    max_calls = 1 if named is not None or not tools.parallel else None
    names = frozenset([named] if named is not None else tools.names)
    schemas = {name: tools.schema(name) for name in sorted(names)}
    constraint = ToolCallConstraint(fmt, schemas, forced, named, max_calls)
    prefix = fmt.forced_prefix(named) if forced else ""
    return ToolCallPlan(fmt, names, prefix, max_calls, constraint)


def render_with_tools(
    template: ChatTemplate, messages: list[dict[str, Any]], tools: ToolRequest,
    add_generation_prompt: bool, extra: dict[str, Any],
) -> str:  # fmt: skip
    """The prompt text of `messages` with `tools` described: given to a template that reads `tools`, else in a
    system message (`with_tools_described`)."""
    fmt = detect_format(template.source)
    assert fmt is not None, "plan_tools refuses a template without a format first"
    if renders_tools(template.source):
        return template.render(
            messages, add_generation_prompt, {**extra, "tools": list(tools.tools)}
        )
    described = with_tools_described(messages, fmt, list(tools.tools))
    return template.render(described, add_generation_prompt, extra)
