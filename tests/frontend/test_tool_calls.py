"""Tool calls' pure parts, without Ray: the request's tools checked by name; both DeepSeek formats parsed from
hand-written model outputs, a stream's deltas adding up to the whole answer wherever it is cut; malformed
blocks left as content; forced calls (required, a named function) primed from the prompt; reasoning split before
calls; the tiny template rendering calls and results as transformers does, in the form the parser reads back.
(Through the server and the official client: test_tool_calls_http.py.)"""

from __future__ import annotations

import itertools
import json
import random

import pytest
from transformers import AutoTokenizer

from pdserve.cluster.config import RouterConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.frontend.chat_output import ChatOutput
from pdserve.frontend.chat_template import ChatTemplate
from pdserve.frontend.openai_api import CHAT, parse
from pdserve.frontend.request_builder import CheckedRequest, _check_markers_decode, build_request
from pdserve.frontend.tool_format import DEEPSEEK_V3, DEEPSEEK_V31, detect_format
from pdserve.frontend.tool_parser import ToolCallParser
from pdserve.frontend.tool_request import ToolRequest, parse_tools, plan_tools, render_with_tools
from pdserve.frontend.validation import ModelInfo
from pdserve.model.errors import InvalidRequestError
from pdserve.model.tokenizer import (
    THINK_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
    Tokenizer,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add"}}
NAMES = frozenset({"get_weather", "add"})
FORMATS = [DEEPSEEK_V3, DEEPSEEK_V31]

V3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}<｜Assistant｜>"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}"
    "{{ m['content'] or '' }}" + TOOL_CALLS_BEGIN + "{% for c in m['tool_calls'] %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}" + TOOL_CALL_BEGIN + "{{ c['type'] }}" + TOOL_SEP
    + "{{ c['function']['name'] }}\n```json\n{{ c['function']['arguments'] }}\n```"
    + TOOL_CALL_END + "{% endfor %}" + TOOL_CALLS_END + "{{ eos_token }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>"
    "{% endif %}{% endfor %}"
)  # fmt: skip
"""A template that writes earlier calls in DeepSeek-V3's (V3-0324's, R1's) form: typed, JSON-fenced, one per
line."""


def cuts(text: str, rng: random.Random) -> list[str]:
    """`text` cut into pieces at random places (every piece non-empty)."""
    at = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in itertools.pairwise([0, *at, len(text)])]


def run(fmt, pieces, names=NAMES, primed="", max_calls=None):
    """(content, [(name, arguments)], deltas) of an output given in `pieces`."""
    ids = itertools.count()
    parser = ToolCallParser(fmt, names, primed, max_calls, call_id=lambda: f"call_{next(ids)}")
    content, deltas = "", []
    for piece in pieces:
        more, touched = parser.push(piece)
        content, deltas = content + more, deltas + touched
    more, touched = parser.finish()
    calls = [(c.name, c.arguments) for c in parser.calls]
    return content + more, calls, deltas + touched


def assembled(deltas: list[dict]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call, as a client puts a stream's deltas together."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        if delta["index"] not in calls:
            assert {"id", "type"} <= delta.keys() and "name" in delta["function"], delta
            calls[delta["index"]] = {
                "id": delta["id"],
                "name": delta["function"]["name"],
                "args": "",
            }
        calls[delta["index"]]["args"] += delta["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return [(c["id"], c["name"], c["args"]) for c in calls.values()]


CALLS = [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": "``` inside ```"}')]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("before", ["", "Let me check.\n"])
def test_calls_parse_whole_and_in_any_chunking(fmt, before):
    text = before + fmt.calls_text(CALLS)
    content, calls, deltas = run(fmt, [text])
    assert (content, calls) == (before, CALLS)
    assert assembled(deltas) == [("call_0", *CALLS[0]), ("call_1", *CALLS[1])]
    rng = random.Random(0)
    for _ in range(60):
        content, calls, deltas = run(fmt, cuts(text, rng))
        assert (content, calls) == (before, CALLS)
        assert [(n, a) for _, n, a in assembled(deltas)] == CALLS


def test_the_v3_format_tolerates_a_missing_fence_and_blanks_between_calls():
    call = TOOL_CALL_BEGIN + "function" + TOOL_SEP + "add\n" + '{"a": 1}' + TOOL_CALL_END
    text = TOOL_CALLS_BEGIN + call + "\n\n" + call + TOOL_CALLS_END
    assert run(DEEPSEEK_V3, [text])[:2] == ("", [("add", '{"a": 1}')] * 2)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(
    "block",
    [
        TOOL_CALLS_BEGIN + "not a call",
        TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "no separator ever" + TOOL_CALL_END,
        TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "x" * 300,
        TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "get_wea",  # the output ends in the head
        TOOL_CALLS_BEGIN,
    ],
)
def test_a_malformed_block_is_content(fmt, block):
    text = "Sure. " + block
    rng = random.Random(1)
    for pieces in [[text], *(cuts(text, rng) for _ in range(20))]:
        assert run(fmt, pieces) == (text, [], [])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_unknown_names_and_what_follows_a_block_are_content(fmt):
    unknown = fmt.calls_text([("rm_rf", "{}")])
    assert run(fmt, [unknown])[:2] == (unknown, [])
    after = fmt.calls_text(CALLS[:1]) + " trailing"
    assert run(fmt, [after])[:2] == (" trailing", CALLS[:1])
    # A call then junk instead of another call: the call stays, the junk is content.
    junk = fmt.calls_text(CALLS[:1]).removesuffix(TOOL_CALLS_END) + "oops"
    assert run(fmt, [junk])[:2] == ("oops", CALLS[:1])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_forced_calls_are_primed_from_the_prompt(fmt):
    # Named: the call is open before the model writes anything; its first delta comes with the first piece.
    named = fmt.forced_prefix("add")
    rest = '{"a": 2}' + fmt.call_tail() + TOOL_CALLS_END
    content, calls, deltas = run(fmt, [rest], primed=named)
    assert (content, calls) == ("", [("add", '{"a": 2}')])
    assert run(fmt, ["", rest], primed=named)[2][0]["function"]["name"] == "add"
    # An output cut short (max_tokens) keeps the call with the arguments so far.
    assert run(fmt, ['{"a":'], primed=named)[:2] == ("", [("add", '{"a":')])
    # Required: the model names the function; a name that is none of them is content, without the prefix.
    required = fmt.forced_prefix(None)
    head = fmt.call_head("get_weather").removeprefix(fmt.call_head())
    assert run(fmt, [head + "{}" + fmt.call_tail()], primed=required)[1] == [("get_weather", "{}")]
    assert run(fmt, ["nothing useful"], primed=required)[:2] == ("nothing useful", [])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_calls_past_the_limit_are_dropped(fmt):
    text = fmt.calls_text(CALLS) + "after"
    assert run(fmt, [text], max_calls=1)[:2] == ("after", CALLS[:1])


def checked(plan, in_think: bool) -> CheckedRequest:
    return CheckedRequest("", [0], SamplingParams(), (), 1, None, in_think, plan)


def test_reasoning_is_split_off_before_calls_and_the_finish_reason_says_tool_calls(model_dir):
    template = ChatTemplate.load(model_dir)
    plan = plan_tools(parse_tools(body(tools=[WEATHER, ADD])), template)
    text = "plan it" + THINK_END + "Checking." + DEEPSEEK_V31.calls_text(CALLS)
    whole = ChatOutput(checked(plan, True), reasoning=True)
    whole.push(text, last=True)
    message = whole.message()
    assert message["reasoning_content"] == "plan it" and message["content"] == "Checking."
    assert [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ] == CALLS
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    rng = random.Random(2)
    for _ in range(30):
        stream = ChatOutput(checked(plan, True), reasoning=True)
        pieces = cuts(text, rng)
        bodies = [stream.push(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(b.get("reasoning_content", "") for b in bodies) == "plan it"
        assert "".join(b.get("content", "") for b in bodies) == "Checking."
        deltas = [d for b in bodies for d in b.get("tool_calls", [])]
        assert [(n, a) for _, n, a in assembled(deltas)] == CALLS
    # Without tools the markers are plain content.
    plain = ChatOutput(checked(None, False), reasoning=None)
    assert plain.push(text, last=True) == {"content": text}
    assert plain.finish_reason("stop") == "stop" and "tool_calls" not in plain.message()


TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and 1+1?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(CALLS)
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_1", "content": "2"},
]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_the_tiny_template_renders_calls_and_results_as_transformers_in_the_parsed_form(
    model_dir, generation_prompt
):
    template = ChatTemplate.load(model_dir)
    assert detect_format(template.source) == DEEPSEEK_V31
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    for turns in (TURNS, [*TURNS, {"role": "assistant", "content": "Sunny; 2."}]):
        ours = template.render(turns, generation_prompt, {})
        assert ours == hf.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=generation_prompt
        )
    ours = template.render(TURNS, generation_prompt, {})
    # After tool results the answer continues from them: no new assistant turn is opened.
    assert ours.endswith("<｜tool▁output▁begin｜>2<｜tool▁output▁end｜>")
    block = ours[ours.index(TOOL_CALLS_BEGIN) : ours.index(TOOL_CALLS_END) + len(TOOL_CALLS_END)]
    assert run(DEEPSEEK_V31, [block])[:2] == ("", CALLS)


def test_a_v3_template_is_told_apart_and_its_calls_parse_back():
    template = ChatTemplate(V3_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    assert detect_format(template.source) == DEEPSEEK_V3
    text = template.render(TURNS[1:3], False)
    block = text[text.index(TOOL_CALLS_BEGIN) : text.index(TOOL_CALLS_END) + len(TOOL_CALLS_END)]
    assert block == DEEPSEEK_V3.calls_text(CALLS)
    assert run(DEEPSEEK_V3, [block])[:2] == ("", CALLS)
    plain = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", {})
    with pytest.raises(InvalidRequestError, match="no tool-call format") as e:
        plan_tools(ToolRequest((ADD,), "auto"), plain)
    assert e.value.field == "tools"


def test_tools_are_described_as_deepseeks_model_card_gives_them(model_dir):
    tools = ToolRequest((WEATHER,), "auto")
    template = ChatTemplate.load(model_dir)
    text = render_with_tools(template, TURNS[:2], tools, True, {})
    card = (
        "## Tools\nYou have access to the following tools:\n\n### get_weather\n"
        "Description: The weather in a city.\n\n"
        f"Parameters: {json.dumps(WEATHER['function']['parameters'])}\n\n"
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments"
        "<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\nWhere:\n\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces\n"
    )
    # After the request's own system prompt, joined as the template joins system messages.
    assert text.startswith(
        template.special_tokens["bos_token"] + "Be brief.\n\n" + card + "<｜User｜>"
    )
    # A template that reads `tools` itself is given them.
    reads = ChatTemplate("{{ tools | map(attribute='function.name') | join(',') }}", {})
    with_sep = reads.source + TOOL_CALLS_BEGIN + TOOL_SEP  # a format, as plan_tools asks
    assert render_with_tools(ChatTemplate(with_sep, {}), TURNS[:2], tools, True, {}).startswith(
        "get_weather"
    )


def body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "obj"}}}]},
            "tools[0].function.parameters.type",
        ),
        (
            {"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"x": {"type": 5}}}}}]},
            "tools[1].function.parameters.properties.x.type",
        ),
        ({"tools": [ADD, ADD]}, "tools[1].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}},
         "tool_choice.function.name"),
        ({"tools": [ADD], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
         "messages[0].tool_calls[0]"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": 5}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, ]}, None),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages[0].tool_call_id"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(fields, field):
    if field is None:  # an empty list asks for nothing
        parse(body(**fields), CHAT)
        return
    with pytest.raises(InvalidRequestError) as e:
        parse(body(**fields), CHAT)
    assert e.value.field == field


def test_tool_choice_defaults_and_none():
    assert parse_tools(body()) is None and parse_tools(body(tools=[])) is None
    assert parse_tools(body(tools=[ADD])).choice == "auto"
    assert parse_tools(body(tools=[ADD], tool_choice="none")) is None
    assert parse_tools(body(tool_choice="none")) is None
    named = {"type": "function", "function": {"name": "add"}}
    request = parse_tools(body(tools=[ADD, WEATHER], tool_choice=named, parallel_tool_calls=False))
    assert (request.choice, request.parallel) == ("add", False)
    # An earlier call's arguments given as an object are written as JSON for the template.
    turns = [
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}
    ]
    message = parse({"messages": turns}, CHAT).input.messages[0]
    assert (
        message["content"] is None
        and message["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    )


@pytest.fixture(scope="module")
def model(model_dir) -> ModelInfo:
    return ModelInfo.load(model_dir, "tiny")


@pytest.mark.parametrize("thinking", [False, True])
def test_a_forced_call_extends_the_prompt_and_carries_the_constraint(model, thinking):
    tools = [WEATHER, ADD]
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = {"chat_template_kwargs": {"thinking": thinking}}
    auto = build_request(parse(body(tools=tools, **kwargs), CHAT).input, model, RouterConfig())
    forced = build_request(
        parse(body(tools=tools, tool_choice=named, **kwargs), CHAT).input, model, RouterConfig()
    )
    assert auto.tool_calls.forced_prefix == "" and not auto.tool_calls.constraint.forced
    assert auto.prompt_in_think == thinking
    # auto: a call block the model opens is masked from its opening token, thinking or not; not where the
    # output ignores EOS (a grammar ends it), nor where a response_format constrains it already
    assert auto.params.structured.start_after == model.tokenizer.token_id(TOOL_CALLS_BEGIN)
    for extra in ({"ignore_eos": True}, {"response_format": {"type": "json_object"}}):
        other = build_request(
            parse(body(tools=tools, **kwargs, **extra), CHAT).input, model, RouterConfig()
        )
        assert other.params.structured is None or other.params.structured.kind == "json_object"
    if thinking:  # the model reasons first, then writes the whole call block, masked from </think>
        assert forced.prompt_ids == auto.prompt_ids and forced.prompt_in_think
        assert forced.tool_calls.forced_prefix == ""
        assert forced.params.structured.start_after == model.tokenizer.token_id(THINK_END)
        tid = model.tokenizer.token_id(TOOL_CALLS_BEGIN)
        assert forced.params.structured.text.startswith(f"start: <[{tid}]> ")
    else:
        suffix = model.tokenizer.encode(DEEPSEEK_V31.forced_prefix("get_weather"), add_bos=False)
        assert forced.prompt_ids == auto.prompt_ids + suffix and not forced.prompt_in_think
        assert forced.params.structured.start_after is None
    constraint = forced.tool_calls.constraint
    assert (constraint.named, constraint.max_calls, constraint.forced) == ("get_weather", 1, True)
    assert constraint.arguments_schema("get_weather") == WEATHER["function"]["parameters"]
    assert forced.tool_calls.names == {"get_weather"}
    none = build_request(
        parse(body(tools=tools, tool_choice="none"), CHAT).input, model, RouterConfig()
    )
    plain = build_request(parse(body(), CHAT).input, model, RouterConfig())
    assert none.prompt_ids == plain.prompt_ids and none.tool_calls is None


def test_a_forced_call_after_the_reasoning_is_masked_from_the_think_end_and_parses(
    model, model_dir
):
    """Asked to think, a required call's grammar (the whole call block) masks only after `</think>`: free
    reasoning, then a block the mask allows token by token, then EOS alone; the answer is the reasoning and
    the call."""
    import torch

    from pdserve.engine.grammar_masks import GrammarMatchers
    from pdserve.engine.step import SampleSpec

    thinking = {"chat_template_kwargs": {"thinking": True}}
    checked = build_request(
        parse(body(tools=[WEATHER, ADD], tool_choice="required", **thinking), CHAT).input,
        model, RouterConfig(),
    )  # fmt: skip
    text = (
        "Paris, I think."
        + THINK_END
        + DEEPSEEK_V31.calls_text([("get_weather", '{"city":"Paris"}')])
    )
    eos = model.tokenizer.eos_id
    matchers = GrammarMatchers(model_dir / "tokenizer.json", model.vocab_size, [eos])
    words = torch.arange(32, dtype=torch.int32)
    for step, token in enumerate([*model.tokenizer.encode(text, add_bos=False), eos]):
        row = SampleSpec.of(checked.params, step, counted=step > 0)
        masks, errors = matchers.masks(["r"], [row], torch.device("cpu"))
        allowed = ((masks.bitmask[0][:, None] >> words) & 1).flatten()[: model.vocab_size]
        assert not errors and allowed[token], (step, token)
        if token == eos:
            assert allowed.sum() == 1
        else:
            matchers.accept(["r"], [row], [token], errors)
    answer = ChatOutput(checked, reasoning=checked.prompt_in_think).push(text, last=True)
    assert answer["reasoning_content"] == "Paris, I think." and "content" not in answer
    (call,) = answer["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == (
        "get_weather", '{"city":"Paris"}',
    )  # fmt: skip


def test_an_auto_call_block_the_model_opens_is_masked_to_the_tools_and_parses(model, model_dir):
    """tool_choice auto: free text (any token, EOS too) until the output writes TOOL_CALLS_BEGIN; then only
    calls of the request's functions with arguments their schema validates, the block's end, EOS."""
    import torch

    from pdserve.engine.grammar_masks import GrammarMatchers
    from pdserve.engine.step import SampleSpec

    checked = build_request(parse(body(tools=[WEATHER, ADD]), CHAT).input, model, RouterConfig())
    eos = model.tokenizer.eos_id
    matchers = GrammarMatchers(model_dir / "tokenizer.json", model.vocab_size, [eos])
    words = torch.arange(32, dtype=torch.int32)
    begin = model.tokenizer.token_id(TOOL_CALLS_BEGIN)
    text = "Let me check." + DEEPSEEK_V31.calls_text([("get_weather", '{"city":"Paris"}')])
    tokens = model.tokenizer.encode(text, add_bos=False)
    opened = tokens.index(begin)
    for step, token in enumerate([*tokens, eos]):
        row = SampleSpec.of(checked.params, step, counted=step > 0)
        masks, errors = matchers.masks(["r"], [row], torch.device("cpu"))
        assert not errors
        if step <= opened:  # free: no mask for this row (or every token allowed)
            assert masks is None or bool(((masks.bitmask[0][:, None] >> words) & 1).all())
        else:
            allowed = ((masks.bitmask[0][:, None] >> words) & 1).flatten()[: model.vocab_size]
            assert allowed[token], (step, token)
            if token == eos:
                assert allowed.sum() == 1
            if step == opened + 1:  # the block's first token: a call's opening, not text
                assert not allowed[model.tokenizer.encode("x", add_bos=False)[0]]
        if token != eos:
            matchers.accept(["r"], [row], [token], errors)
    answer = ChatOutput(checked, reasoning=False).push(text, last=True)
    (call,) = answer["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == (
        "get_weather", '{"city":"Paris"}',
    )  # fmt: skip


def test_a_tokenizer_that_drops_the_markers_asks_for_special_tokens(model_dir, tmp_path):
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["special"] = token["special"] or token["content"] == TOOL_CALLS_BEGIN
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    dropping = Tokenizer(tmp_path)
    with pytest.raises(InvalidRequestError, match="skip_special_tokens: false") as e:
        _check_markers_decode(dropping, None)
    assert e.value.field == "tools"
    _check_markers_decode(dropping, False)
    _check_markers_decode(Tokenizer(model_dir), None)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_any_mix_of_markers_and_text_parses_the_same_whole_and_streamed(fmt):
    """Outputs made of call pieces in random order (what a model without a grammar mask may write) never fail
    the parser, and every chunking of them answers as the whole does."""
    parts = [
        TOOL_CALLS_BEGIN, TOOL_CALL_BEGIN, TOOL_SEP, TOOL_CALL_END, TOOL_CALLS_END, "function",
        "add", "get_weather", "\n```json\n", "\n```", '{"a": 1}', "``", " ", "\n", "x", THINK_END,
    ]  # fmt: skip
    rng = random.Random(3)
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 14)))
        primed = rng.choice(["", fmt.forced_prefix(None), fmt.forced_prefix("add")])
        content, calls, deltas = run(fmt, [text], primed=primed)
        assert [(n, a) for _, n, a in assembled(deltas)] == calls
        for _ in range(3):
            streamed = run(fmt, cuts(text, rng) if len(text) > 1 else [text], primed=primed)
            assert streamed[:2] == (content, calls), text


def test_a_forced_call_grammar_takes_the_markers_as_tokens_and_compiles():
    """The call markers that are one token each are that token in the grammar (llguidance reads an added
    token as a token, not as its text's bytes); every format and choice gives a grammar llguidance compiles;
    an `auto` choice's grammar starts after the block's opening token, and there is none without one."""
    from pdserve.engine.grammar import check
    from pdserve.frontend.tool_format import DEEPSEEK_V3, DEEPSEEK_V31
    from pdserve.frontend.tool_grammar import _literal, auto_call_grammar, forced_call_grammar
    from pdserve.frontend.tool_request import ToolCallConstraint
    from pdserve.model.tokenizer import TOOL_CALL_END, TOOL_CALLS_END

    ids = {TOOL_CALL_END: 7, TOOL_CALLS_END: 8}
    assert (
        _literal("\n```" + TOOL_CALL_END + "x" + TOOL_CALLS_END, ids.get)
        == '"\\n```" <[7]> "x" <[8]>'
    )
    assert _literal(TOOL_CALL_END, {}.get) == f'"{TOOL_CALL_END}"'
    schemas = {
        "f": {"type": "object"},
        "g": {"type": "object", "properties": {"a": {"type": "integer"}}},
    }
    for fmt in (DEEPSEEK_V3, DEEPSEEK_V31):
        for named, max_calls in (("f", 1), (None, 1), (None, None)):
            grammar = forced_call_grammar(
                ToolCallConstraint(fmt, schemas, True, named, max_calls), ids.get
            )
            assert grammar.text.startswith("start: first_call") and "<[8]>" in grammar.text
            check(grammar, "tool_choice")
    auto = ToolCallConstraint(DEEPSEEK_V31, schemas, False, None, None)
    with pytest.raises(ValueError, match="forced"):
        forced_call_grammar(auto, ids.get)
    with pytest.raises(ValueError, match="forced call's grammar"):
        auto_call_grammar(ToolCallConstraint(DEEPSEEK_V31, schemas, True, None, None), ids.get)
    assert auto_call_grammar(auto, ids.get) is None  # no single token opens the block
    opening = {**ids, TOOL_CALLS_BEGIN: 6}
    for fmt in (DEEPSEEK_V3, DEEPSEEK_V31):
        for max_calls in (1, None):
            grammar = auto_call_grammar(
                ToolCallConstraint(fmt, schemas, False, None, max_calls), opening.get
            )
            assert grammar.start_after == 6 and grammar.text.startswith("start: call")
            assert ("next_call" in grammar.text) == (max_calls is None)
            check(grammar, "tool_choice")
