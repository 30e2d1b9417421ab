"""Tool calls through the official `openai` client on the session's shared tiny server: the prompt is the
checkpoint's template with the tools described (as transformers renders and tokenizes it), extended by a forced
call's start for a named function (not where the model thinks first); the answer's calls are what the parser
makes of the greedy output, streamed deltas adding up to them; earlier calls and tool results go back in; bad
tools are 400 naming the field.

The tiny model has random weights: it writes no call of its own accord, and only the grammar mask of a forced
call (`frontend/tool_grammar.py`) makes its arguments JSON that their schema validates."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from pdserve.frontend.tool_format import DEEPSEEK_V31, with_tools_described

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        },
    },
}
TOOLS = [WEATHER, ADD]
# Schemas whose instances are short (a random model's free strings and extra properties run to max_tokens)
STRICT = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -999, "maximum": 999},
                    "b": {"type": "integer", "minimum": -999, "maximum": 999},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
GREEDY = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def prompt_ids(model_dir):
    """A tools request's prompt ids as transformers renders and tokenizes the template (the tools described in
    a system message, as the checkpoint's own template leaves them to the system prompt)."""
    hf = AutoTokenizer.from_pretrained(str(model_dir))

    def ids(messages, tools=None, forced: str = "") -> list[int]:
        if tools:
            messages = with_tools_described(messages, DEEPSEEK_V31, tools)
        text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return hf(text, add_special_tokens=False)["input_ids"] + (
            hf(forced, add_special_tokens=False)["input_ids"] if forced else []
        )

    return ids


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("choice", ["get_weather", "required"])
def test_a_forced_call_parses_whole_and_streamed(api, model, prompt_ids, choice, seed):
    """A named or required call's output is masked to the call block's grammar: on random weights too, the
    answer is calls whose names are the request's functions and whose arguments are JSON valid against their
    schema, ended by the model itself (`tool_calls`); the stream's deltas add up to the same calls."""
    named = choice != "required"
    tool_choice = NAMED if named else "required"
    sampled = {"max_tokens": 200, "temperature": 1.0, "seed": seed}
    reply = api.chat.completions.create(
        model=model, messages=ASK, tools=STRICT, tool_choice=tool_choice, **sampled
    )
    (answer,) = reply.choices
    assert reply.usage.prompt_tokens == len(
        prompt_ids(ASK, STRICT, DEEPSEEK_V31.forced_prefix(choice if named else None))
    )
    assert answer.finish_reason == "tool_calls", answer
    calls = answer.message.tool_calls
    assert calls and answer.message.content is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in STRICT}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (["get_weather"] if named else schemas)
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if named:
        assert len(calls) == 1

    stream = api.chat.completions.create(
        model=model, messages=ASK, tools=STRICT, tool_choice=tool_choice, stream=True, **sampled
    )
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    streamed: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in streamed and d.type == "function"
            streamed[d.index] = [d.function.name, ""]
        streamed[d.index][1] += d.function.arguments or ""
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_forced_call_comes_after_the_reasoning(api, model, prompt_ids):
    """Asked to think, a required call is not forced at once: the prompt is the template's, opening the think
    block, and the reasoning is the model's own (the call block's grammar masks only after `</think>`:
    test_tool_calls.py); a budget that ends inside the think block finishes at its length with no call."""
    reply = api.chat.completions.create(
        model=model, messages=ASK, tools=STRICT, tool_choice="required", max_tokens=8,
        temperature=0, extra_body={"chat_template_kwargs": {"thinking": True}},
    )  # fmt: skip
    (answer,) = reply.choices
    assert answer.finish_reason == "length" and answer.message.reasoning_content
    assert not answer.message.tool_calls and not answer.message.content
    # no call's start added: as long as the prompt that does not think (`</think>` where it has `<think>`)
    assert reply.usage.prompt_tokens == len(prompt_ids(ASK, STRICT))
    assert reply.usage.completion_tokens == 8


def test_auto_and_none_render_the_tools_or_not(api, model, prompt_ids):
    auto = api.chat.completions.create(model=model, messages=ASK, tools=TOOLS, **GREEDY)
    assert auto.usage.prompt_tokens == len(prompt_ids(ASK, TOOLS))
    # The random model writes no call block: its answer is content, as without tools.
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason == "length"
    none = api.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", **GREEDY
    )
    plain = api.chat.completions.create(model=model, messages=ASK, **GREEDY)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens == len(prompt_ids(ASK))
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_tool_results_go_back_in(api, model, prompt_ids):
    turns = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = api.chat.completions.create(model=model, messages=turns, tools=TOOLS, **GREEDY)
    assert reply.usage.prompt_tokens == len(prompt_ids(turns, TOOLS))
    assert reply.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    "params, field",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "obj"}}}]},
         "tools[0].function.parameters.type"),
        ({"tools": [ADD, ADD]}, "tools[1].function.name"),
    ],
)  # fmt: skip
def test_bad_tools_are_400_naming_the_field(api, model, params, field):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=model, messages=ASK, max_tokens=1, **params)
    assert e.value.status_code == 400 and e.value.body["param"] == field
