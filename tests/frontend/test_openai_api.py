"""The OpenAI front end's pure parts, without Ray: chat templates render as transformers renders them, the
reasoning split of a stream equals the whole text's wherever the stream is cut, and request parameters the engine
cannot honour are refused by name; the usage object has speculation's figures only where there were drafts."""

from __future__ import annotations

import itertools
import random

import pytest
from transformers import AutoTokenizer

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.errors import (
    DeadlineExceededError,
    NotFoundError,
    UnavailableError,
    WorkerFailedError,
)
from pdserve.engine.messages import SpecCounts
from pdserve.frontend.chat_template import ChatTemplate
from pdserve.frontend.errors import http_error_for
from pdserve.frontend.json_body import MAX_JSON_DEPTH, decode_body
from pdserve.frontend.openai_api import CHAT, COMPLETIONS, parse, usage
from pdserve.frontend.openai_fields import IGNORED, ignored_names
from pdserve.frontend.prompt_batch import MAX_PROMPTS
from pdserve.frontend.reasoning import ReasoningSplitter, prompt_opens_think, split_reasoning
from pdserve.frontend.text_stream import TextStream
from pdserve.frontend.validation import (
    MAX_STOP_STRINGS,
    FieldNames,
    ModelInfo,
    SamplingRequest,
    check_n,
    check_stop_strings,
    sampling_params,
)
from pdserve.model.errors import CapacityError, InvalidRequestError
from pdserve.model.tokenizer import CHAT_TOKENS, EOS_TOKEN, THINK_END, THINK_START, Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>Add them.</think>4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}],
]
# Block tags on lines of their own, tojson and loop controls: what trim_blocks, lstrip_blocks, the tojson
# filter and the loopcontrols extension change.
LAYOUT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
    <{{ message['role'] }}>{{ message['content'] | tojson }}
{% endfor %}
{% if add_generation_prompt %}
<assistant>
{% endif %}"""


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


def test_tiny_checkpoint_has_r1_chat_tokens_and_template(model_dir):
    tokenizer = Tokenizer(model_dir)
    ids = [tokenizer.token_id(t) for t in CHAT_TOKENS]
    assert None not in ids and max(ids) < ModelInfo.load(model_dir, "tiny").vocab_size
    # Added, not special: decoded text keeps them (a reasoning split needs </think> in the text).
    assert tokenizer.decode([ids[-1]]) == THINK_END
    assert ModelInfo.load(model_dir, "tiny").thinks


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_renders_as_transformers(
    model_dir, hf_tokenizer, conversation, generation_prompt, thinking
):
    messages = CONVERSATIONS[conversation]
    template = ChatTemplate.load(model_dir)
    kwargs = {} if thinking is None else {"thinking": thinking}
    ours = template.render(messages, generation_prompt, kwargs)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
    )
    assert ours == theirs
    # The tiny model thinks only when asked: its generation prompt opens a think block then, and closes
    # it otherwise (DeepSeek-V3.1's two modes).
    assert prompt_opens_think(ours) == bool(generation_prompt and thinking)
    if generation_prompt:
        assert ours.endswith(THINK_START if thinking else THINK_END)
    if thinking is not None:
        return
    layout = ChatTemplate(LAYOUT_TEMPLATE, template.special_tokens)
    theirs = hf_tokenizer.apply_chat_template(
        messages, chat_template=LAYOUT_TEMPLATE, tokenize=False,
        add_generation_prompt=generation_prompt,
    )  # fmt: skip
    assert layout.render(messages, generation_prompt) == theirs


def test_chat_template_refusal_names_messages(model_dir):
    template = ChatTemplate.load(model_dir)
    with pytest.raises(
        InvalidRequestError, match="roles must be system, user, assistant or tool"
    ) as e:
        template.render([{"role": "developer", "content": "x"}])
    assert e.value.field == "messages"
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(InvalidRequestError) as e:
        sandboxed.render([{"role": "user", "content": "x"}])
    assert e.value.field == "messages"


def _naive_split(text: str, in_think: bool) -> tuple[str, str]:
    """The reference: a leading <think> dropped, reasoning before the first </think>, content after it; where
    the prompt left no think block open, all content unless the text opens one."""
    if not in_think and not text.startswith("<think>"):
        return "", text
    text = text.removeprefix("<think>")
    reasoning, closed, content = text.partition("</think>")
    return (reasoning, content) if closed else (text, "")


TEXTS = [
    "plan it</think>\n\nanswer",
    "<think>opened, never closed",
    "<think>plan</think>answer </think> again",
    "never closes <think> the block",
    "</think>",
    "<thi",
    "<think",
    "ends in a partial </thi",
    "",
    "plain",
]


@pytest.mark.parametrize("in_think", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_reasoning_split_of_any_stream_equals_the_whole(text, in_think):
    expected = _naive_split(text, in_think)
    assert split_reasoning(text, in_think) == expected
    cuts = list(itertools.combinations(range(1, len(text)), 2)) if len(text) < 40 else []
    rng = random.Random(0)
    cuts += [sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1))) for _ in range(20)]
    for cut in cuts:
        bounds = [0, *cut, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        splitter, reasoning, content = ReasoningSplitter(in_think), "", ""
        for piece in pieces:
            r, c = splitter.push(piece)
            reasoning, content = reasoning + r, content + c
        r, c = splitter.flush()
        assert (reasoning + r, content + c) == expected, pieces


@pytest.mark.parametrize(
    "kind, body, param",
    [
        (CHAT, {"n": "two"}, "n"),
        (COMPLETIONS, {"stop": 5}, "stop"),
        (CHAT, {"stop": ["a", 1]}, "stop"),
        (CHAT, {"logprobs": 1}, "logprobs"),
        (COMPLETIONS, {"logprobs": True}, "logprobs"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
        (CHAT, {"presence_penalty": "high"}, "presence_penalty"),
        (CHAT, {"frequency_penalty": [1]}, "frequency_penalty"),
        (CHAT, {"repetition_penalty": float("inf")}, "repetition_penalty"),
        (CHAT, {"min_tokens": 1.5}, "min_tokens"),
        (CHAT, {"logit_bias": {"5": 1}}, "logit_bias"),
        (COMPLETIONS, {"echo": "yes"}, "echo"),
        (COMPLETIONS, {"prompt_logprobs": 1.5}, "prompt_logprobs"),
        (CHAT, {"prompt_logprobs": 1}, "prompt_logprobs"),
        (COMPLETIONS, {"best_of": 2}, "best_of"),
        (CHAT, {"tools": [{"type": "function"}]}, "tools[0].function"),
        (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
        (CHAT, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (COMPLETIONS, {"guided_regex": "[a-z"}, "guided_regex"),
        (COMPLETIONS, {"guided_choice": []}, "guided_choice"),
        (COMPLETIONS, {"guided_grammar": "start: missing_rule"}, "guided_grammar"),
        (COMPLETIONS, {"guided_json": "{not json"}, "guided_json"),
        (
            COMPLETIONS,
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs.choice",
        ),
        (COMPLETIONS, {"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
        (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        (CHAT, {"skip_special_tokens": "no"}, "skip_special_tokens"),
        (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT, {"temperature": "hot"}, "temperature"),
        (CHAT, {"max_tokens": 1.5}, "max_tokens"),
        (CHAT, {"seed": True}, "seed"),
        (CHAT, {"store": "yes"}, "store"),
        (CHAT, {"metadata": ["a"]}, "metadata"),
        (CHAT, {"parallel_tool_calls": 1}, "parallel_tool_calls"),
        (
            CHAT,
            {"stream": True, "stream_options": {"continuous_usage_stats": "on"}},
            "stream_options.continuous_usage_stats",
        ),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": ["a", ""]}, "prompt[1]"),
        (COMPLETIONS, {"prompt": [[1, 2], "b", 3]}, "prompt[2]"),
        (COMPLETIONS, {"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt"),
        (COMPLETIONS, {"prompt": ["a"] * 20, "n": 13}, "n"),
        (CHAT, {"messages": []}, "messages"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        (COMPLETIONS, {"prompt": None}, "prompt"),
        (COMPLETIONS, {"suffix": "x"}, "suffix"),
    ],
)
def test_unsupported_or_malformed_parameters_are_refused_by_name(kind, body, param):
    base = {"model": "m"}
    base.update(
        {"messages": [{"role": "user", "content": "hi"}]} if kind == CHAT else {"prompt": "hi"}
    )
    base.update(body)
    with pytest.raises(InvalidRequestError) as e:
        parse(base, kind)
    assert e.value.field == param


def test_values_that_ask_for_nothing_are_accepted():
    request = parse(
        {
            "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "stop": [],
            "tools": [], "user": "u", "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 7, "max_tokens": 99, "top_k": 5, "min_p": 0.1, "ignore_eos": True,
            "stop_token_ids": [1, 2], "seed": 3,
        },
        CHAT,
    )  # fmt: skip
    given = request.input
    assert given.messages == [{"role": "user", "content": "hi"}]
    assert given.sampling.max_tokens == 7 and given.names.max_tokens == "max_completion_tokens"
    assert given.sampling.stop_token_ids == (1, 2) and given.sampling.ignore_eos
    assert request.stream and request.include_usage
    ids = parse({"prompt": [[0, 5, 6]]}, COMPLETIONS).input
    assert ids.prompt_ids == [0, 5, 6] and ids.prompt_text is None


def test_openai_parameters_vllm_ignores_and_unknown_names_are_ignored_and_listed():
    values = {
        "store": True, "metadata": {"k": "v"}, "service_tier": "auto", "reasoning_effort": "low",
        "modalities": ["text"], "prediction": {"type": "content", "content": "x"},
        "verbosity": "low", "prompt_cache_key": "k", "safety_identifier": "s",
    }  # fmt: skip
    assert set(values) == set(IGNORED)
    body = {
        "messages": [{"role": "user", "content": "hi"}], **values, "frobnicate": 1,
        "user": "u", "store_later": None, "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False, "zip": 1},
    }  # fmt: skip
    request = parse(body, CHAT)
    assert request.ignored == (
        *values, "frobnicate", "store_later", "stream_options.include_obfuscation",
        "stream_options.zip",
    )  # fmt: skip
    assert request.include_usage and not request.continuous_usage
    # a given null asks for nothing: not listed
    assert parse({"prompt": "a", "store": None}, COMPLETIONS).ignored == ()
    # what the header shows: plain names, the rest counted
    assert ignored_names(("store", "a\r\nb", "x" * 65, "metadata")) == "store, metadata, (2 more)"


def test_continuous_usage_takes_effect_with_include_usage_as_in_vllm():
    def options(**given):
        return parse({"prompt": "a", "stream": True, "stream_options": given}, COMPLETIONS)

    both = options(include_usage=True, continuous_usage_stats=True)
    assert both.include_usage and both.continuous_usage and both.ignored == ()
    alone = options(continuous_usage_stats=True)
    assert not alone.include_usage and not alone.continuous_usage


def test_a_list_of_prompts_is_one_input_per_prompt_each_named_by_its_place():
    request = parse({"prompt": ["a cat", [0, 5, 6]], "n": 3, "max_tokens": 4}, COMPLETIONS)
    assert [(g.prompt_text, g.prompt_ids) for g in request.inputs] == [
        ("a cat", None), (None, [0, 5, 6]),
    ]  # fmt: skip
    assert [g.names.prompt_text for g in request.inputs] == ["prompt[0]", "prompt[1]"]
    assert all(g.n == 3 and g.sampling.max_tokens == 4 for g in request.inputs)
    assert (request.n, request.num_choices) == (3, 6)
    ids = parse({"prompt": [[1, 2], [3, 4]]}, COMPLETIONS)
    assert [g.prompt_ids for g in ids.inputs] == [[1, 2], [3, 4]]
    assert parse({"prompt": ["one"]}, COMPLETIONS).input.names.prompt_text == "prompt"
    assert len(parse({"prompt": ["a"] * MAX_PROMPTS}, COMPLETIONS).inputs) == MAX_PROMPTS


def test_sampling_parameters_reach_the_sampling_request():
    chat = parse(
        {
            "messages": [{"role": "user", "content": "hi"}], "n": 3, "logprobs": True,
            "top_logprobs": 4, "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.2, "min_tokens": 2, "skip_special_tokens": False,
        },
        CHAT,
    )  # fmt: skip
    s = chat.input.sampling
    assert chat.n == 3 and (s.logprobs, chat.input.names.logprobs) == (4, "top_logprobs")
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1, 1.2)
    assert s.min_tokens == 2 and s.skip_special_tokens is False
    only = parse({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, CHAT)
    assert only.input.sampling.logprobs == 0 and only.n == 1
    plain = parse({"messages": [{"role": "user", "content": "hi"}]}, CHAT).input
    assert plain.sampling.logprobs is None
    legacy = parse({"prompt": "hi", "logprobs": 2}, COMPLETIONS).input
    assert (legacy.sampling.logprobs, legacy.names.logprobs) == (2, "logprobs")


@pytest.mark.parametrize(
    "given, names, field, words",
    [
        (SamplingRequest(logprobs=21), FieldNames(logprobs="top_logprobs"), "top_logprobs",
         "limit of 20 (router.max_logprobs)"),
        (SamplingRequest(logprobs=-1), FieldNames(), "logprobs", "must be in [0, "),
        (SamplingRequest(top_k=2**63), FieldNames(sampling_prefix="sampling_params."),
         "sampling_params.top_k", "must be in [-1, 2147483647]"),
        (SamplingRequest(seed=2**64), FieldNames(), "seed", "got 18446744073709551616"),
        (SamplingRequest(presence_penalty=2.5), FieldNames(), "presence_penalty", "[-2, 2]"),
        (SamplingRequest(repetition_penalty=0.0), FieldNames(), "repetition_penalty", "> 0"),
        (SamplingRequest(max_tokens=4, min_tokens=5), FieldNames(), "min_tokens", "max_tokens=4"),
        (SamplingRequest(top_p=0.0), FieldNames(sampling_prefix="sampling_params."),
         "sampling_params.top_p", "(0, 1]"),
    ],
)  # fmt: skip
def test_sampling_limits_name_the_parameter(model_dir, given, names, field, words):
    model = ModelInfo.load(model_dir, "tiny")
    with pytest.raises(InvalidRequestError) as e:
        sampling_params(given, 3, model, RouterConfig(), names)
    assert e.value.field == field and words in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        check_n(17, RouterConfig(), "n")
    assert e.value.field == "n" and "limit of 16 (router.max_n)" in str(e.value)
    check_n(2, RouterConfig(max_n=2), "n")


def test_skip_special_tokens_decides_whether_the_text_shows_them(model_dir):
    tokenizer = Tokenizer(model_dir)
    ids = [*tokenizer.encode("a cat", add_bos=False), tokenizer.eos_id, 1 + tokenizer.eos_id]

    def text(**kwargs) -> str:
        stream = TextStream(tokenizer, [tokenizer.bos_id], **kwargs)
        return stream.push(ids[:2])[0] + stream.push(ids[2:])[0] + stream.finish()[0]

    assert EOS_TOKEN not in text() and text() == tokenizer.decode(ids)
    shown = text(skip_special_tokens=False)
    assert shown == tokenizer.decode(ids, skip_special_tokens=False) and EOS_TOKEN in shown


def _stream(tokenizer, ids, stop, sizes) -> tuple[str, bool]:
    """The text a TextStream gives for `ids` pushed in pieces of `sizes` (cycled), finish included."""
    stream, text, start, i = TextStream(tokenizer, [0], stop), "", 0, 0
    while start < len(ids):
        piece = ids[start : start + sizes[i % len(sizes)]]
        start, i = start + len(piece), i + 1
        delta, stopped = stream.push(piece)
        text += delta
        if stopped:
            return text, True
    delta, stopped = stream.finish()
    return text + delta, stopped


def test_stop_strings_match_across_tokens_and_are_never_shown(model_dir):
    tokenizer = Tokenizer(model_dir)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, then naps.", add_bos=False)
    whole = tokenizer.decode(ids)
    boundaries = [len(tokenizer.decode(ids[:k])) for k in range(1, len(ids))]
    spanning = [whole[b - 2 : b + 3] for b in boundaries if 2 <= b <= len(whole) - 3]
    assert spanning
    for sizes in ([1], [2, 3], [len(ids)]):
        assert _stream(tokenizer, ids, (), sizes) == (whole, False)
        for stop in spanning:
            expected = whole[: whole.find(stop)]
            assert _stream(tokenizer, ids, (stop,), sizes) == (expected, True), (stop, sizes)
        # The earliest of several stop strings wins; one that never occurs changes nothing.
        stops = (spanning[-1], spanning[len(spanning) // 2], "never there")
        first = min(whole.find(s) for s in stops[:2])
        assert _stream(tokenizer, ids, stops, sizes) == (whole[:first], True)
        assert _stream(tokenizer, ids, ("zzz never", "dog!"), sizes) == (whole, False)


def test_stop_string_limits_name_the_field(model_dir):
    model = ModelInfo.load(model_dir, "tiny")
    assert check_stop_strings(["a", "bc"], model, "stop") == ("a", "bc")
    for stop in (["x"] * (MAX_STOP_STRINGS + 1), [""], ["y" * 1000]):
        with pytest.raises(InvalidRequestError) as e:
            check_stop_strings(stop, model, "sampling_params.stop")
        assert e.value.field == "sampling_params.stop"


@pytest.mark.parametrize(
    "error, status, kind, param",
    [
        (InvalidRequestError("top_p", "must be in (0, 1]"), 400, "invalid_request_error", "top_p"),
        (CapacityError("no decode worker had room"), 429, "rate_limit_error", None),
        (UnavailableError("starting"), 503, "service_unavailable_error", None),
        (DeadlineExceededError("deadline exceeded"), 504, "timeout_error", None),
        (NotFoundError("no such model"), 404, "not_found_error", None),
        (WorkerFailedError("decode-0: decode failed: boom"), 500, "server_error", None),
        (
            WorkerFailedError("decode-0: KV transfer timed out"),
            503,
            "service_unavailable_error",
            None,
        ),
        (RuntimeError("a bug"), 500, "server_error", None),
    ],
)
def test_errors_map_to_http_statuses_in_openai_shape(error, status, kind, param):
    e = http_error_for(error)
    assert (e.status, e.type, e.param) == (status, kind, param)
    body = e.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and str(error) in body["message"]


def test_usage_has_speculation_only_where_the_request_speculated():
    plain = usage(5, 8)
    assert plain == {
        "prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip
    assert usage(5, 8, cached_tokens=4)["prompt_tokens_details"] == {"cached_tokens": 4}
    assert "speculative" not in usage(5, 8, {"router_queue_s": 0.1}, None)
    speculated = usage(5, 8, None, SpecCounts.total([SpecCounts(6, 3, 4), SpecCounts(2, 1, 1)]))
    assert speculated["speculative"] == {
        "draft_tokens": 8, "accepted_tokens": 4, "mean_accepted_length": 1.8,
    }  # fmt: skip


def test_a_body_is_decoded_only_when_the_api_can_take_its_text_and_depth():
    # A surrogate pair is one character; a lone surrogate is no text at all, wherever it is.
    assert decode_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}
    for raw, field in [
        (b'{"messages": [{"role": "user", "content": "x\\udc00"}]}', "messages[0].content"),
        (b'{"a": {"\\ud800": 1}}', "a"),
        (b'{"stop": ["ok", "\\ud800"]}', "stop[1]"),
        (b'{"user": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}", "user"),
        (b"[" * 5000 + b"]" * 5000, "body"),
        (b"{not json", "body"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            decode_body(raw)
        assert e.value.field == field
        assert "\ud800" not in str(e.value) and "\udc00" not in str(e.value)
    deepest = b'{"user": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert decode_body(deepest)["user"]


def test_echo_and_prompt_logprobs_ask_the_engine_for_the_prompt_s_log_probabilities():
    """echo with logprobs and vLLM's prompt_logprobs ask the engine to score the prompt with the larger of
    their alternatives; echo with max_tokens 0 runs one token, dropped later."""
    cases = [
        ({"echo": True}, None, False),
        ({"echo": True, "logprobs": 1}, 1, False),
        ({"prompt_logprobs": 3, "logprobs": 1}, 3, False),
        ({"echo": True, "logprobs": 4, "prompt_logprobs": 2}, 4, False),
        ({"echo": True, "max_tokens": 0, "logprobs": 0}, 0, True),
        ({"logprobs": 2}, None, False),
    ]
    for body, scored, prompt_only in cases:
        request = parse({"prompt": "hi", **body}, COMPLETIONS)
        assert request.input.sampling.prompt_logprobs == scored, body
        assert request.prompt_only == prompt_only, body
        assert request.input.sampling.max_tokens == (1 if prompt_only else body.get("max_tokens"))
        assert request.echo == body.get("echo", False)
        assert request.prompt_logprobs == body.get("prompt_logprobs")
    # max_tokens 0 without echo is left to the range check, which refuses it
    assert parse({"prompt": "hi", "max_tokens": 0}, COMPLETIONS).input.sampling.max_tokens == 0
