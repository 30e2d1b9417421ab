"""Tool calls through the official `openai` client on the session's shared tiny server: the prompt is the
checkpoint's template with the tools described (as transformers renders and tokenizes it), extended by a forced
call's start for a named function; the answer's calls are what the parser makes of the greedy output, streamed
deltas adding up to them; earlier calls and tool results go back in; bad tools are 400 naming the field.

The tiny model has random weights: it writes no call of its own accord, and the arguments of a forced call are
random text until a grammar mask constrains them, so nothing here asks them to be JSON."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from pdserve.frontend.tool_format import DEEPSEEK_V31, with_tools_described
from pdserve.frontend.tool_parser import ToolCallParser

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


@pytest.mark.parametrize("choice", ["get_weather", "required"])
def test_a_forced_call_whole_and_streamed_is_the_parse_of_the_greedy_output(
    api, model, reference, tokenizer, prompt_ids, choice
):
    named = choice != "required"
    forced = DEEPSEEK_V31.forced_prefix(choice if named else None)
    prompt = prompt_ids(ASK, TOOLS, forced)
    # What the parser makes of the greedy output, the forced start first.
    names = frozenset({choice} if named else {"get_weather", "add"})
    parser = ToolCallParser(DEEPSEEK_V31, names, forced, max_calls=1 if named else None)
    content, _ = parser.push(tokenizer.decode(reference(prompt, GREEDY["max_tokens"])))
    content += parser.finish()[0]
    expected = [(c.name, c.arguments) for c in parser.calls]
    # A named function is called whatever the model writes; `required` leaves the name to the model, and
    # random weights write none of the tools' names.
    assert [name for name, _ in expected] == (["get_weather"] if named else [])
    tool_choice = NAMED if named else "required"

    reply = api.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, **GREEDY
    )
    (answer,) = reply.choices
    assert reply.usage.prompt_tokens == len(prompt)
    calls = answer.message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == expected
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert answer.message.content == (content or None)
    assert answer.finish_reason == "length"  # ignore_eos: the output ran to max_tokens

    stream = api.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, stream=True, **GREEDY
    )
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    if named:
        first = deltas[0]
        assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
        assert first.id.startswith("call_") and all(
            d.index == 0 and d.id is None for d in deltas[1:]
        )
        assert "".join(d.function.arguments or "" for d in deltas) == expected[0][1]
    else:
        assert deltas == []
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    assert chunks[-1].choices[0].finish_reason == "length"


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
