"""Structured outputs through the official `openai` client on the shared tiny server: a random model's output
parses and validates only because the grammar masks its tokens (json_schema, json_object, regex, choice,
streamed too, and a set of generated schemas sent at once), literals spelling an added token too; in thinking
mode the reasoning is free and the content parses; an unusable constraint is a 400 naming its field."""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from pdserve.model.tokenizer import THINK_END, TOOL_CALL_END

# appended: benchmarks/kernels.py must not shadow HF `kernels`, which transformers imports
sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _schemas import random_schema, validate  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("seed", [0, 1])
def test_chat_json_schema_parses_and_validates(api, model, seed):
    reply = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Who are you?"}], max_tokens=200,
        temperature=1.0, seed=seed, response_format=json_schema_format(SCHEMA),
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_object_parses(api, model):
    stream = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "JSON please"}], max_tokens=300,
        temperature=0, response_format={"type": "json_object"}, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_completions_regex_and_choice(api, model):
    regex = r"[a-z]{2,5}-[0-9]{3}"
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        reply = api.completions.create(
            model=model, prompt="Code:", max_tokens=30, temperature=1.0, seed=3, extra_body=extra
        )
        assert re.fullmatch(regex, reply.choices[0].text), reply.choices[0].text
    choices = ["yes", "no", "maybe later"]
    reply = api.completions.create(
        model=model, prompt="Answer:", max_tokens=10, temperature=1.0, seed=5, n=3,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert all(c.text in choices and c.finish_reason == "stop" for c in reply.choices)


@pytest.mark.parametrize(
    "extra, texts",
    [
        ({"guided_choice": [THINK_END, "no"]}, {THINK_END, "no"}),
        ({"guided_regex": "<think>[a-z]{1,3}</think>"}, None),
        (
            {"guided_json": {"const": TOOL_CALL_END}},
            {json.dumps(TOOL_CALL_END, ensure_ascii=False)},
        ),
    ],
)
def test_constraints_spelling_an_added_token_succeed(api, model, extra, texts):
    """A literal whose text is an added token's (`</think>`, a tool-call marker) is generated: the request
    finishes, its text what the constraint says."""
    reply = api.completions.create(
        model=model, prompt="Say:", max_tokens=30, temperature=1.0, seed=4, n=3, extra_body=extra
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        if texts is None:
            assert re.fullmatch(extra["guided_regex"], choice.text), choice.text
        else:
            assert choice.text in texts, choice.text


def test_thinking_leaves_the_reasoning_free_and_its_content_parses(api, model):
    """Asked to think, the template opens a think block: the constraint starts after it closes, so the
    reasoning is the model's own and the content parses; a reply whose budget ends inside the think block
    finishes at its length, with reasoning and no content. Random weights close the block only for some
    questions: both kinds are found among a few."""
    schema = {"enum": ["yes", "no"]}

    def ask(i: int):
        return api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Question {i}: is {i} odd?"}],
            max_tokens=40, temperature=0, response_format=json_schema_format(schema),
            extra_body={"chat_template_kwargs": {"thinking": True}},
        )  # fmt: skip

    with ThreadPoolExecutor(16) as pool:
        choices = [r.choices[0] for r in pool.map(ask, range(16))]
    answered = [c for c in choices if c.finish_reason == "stop" and c.message.content]
    assert answered, "no question made the tiny model close its think block and answer"
    for choice in answered:
        validate(json.loads(choice.message.content), schema)
        assert THINK_END not in choice.message.content + (choice.message.reasoning_content or "")
    cut = [c for c in choices if c.finish_reason == "length" and not c.message.content]
    assert cut, "every question made the tiny model close its think block"
    for choice in cut:
        assert choice.message.reasoning_content


def test_generated_schemas_all_parse_and_validate(api, model):
    """The CI share of the 1,000-schema target (benchmarks/structured_schemas.py), sent at once."""

    def one(seed: int) -> tuple[dict, str]:
        schema = random_schema(seed)
        reply = api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Fill it in."}], max_tokens=400,
            temperature=1.0, seed=seed, response_format=json_schema_format(schema),
        )  # fmt: skip
        return schema, reply.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        for schema, text in pool.map(one, range(20)):
            validate(json.loads(text), schema)


@pytest.mark.parametrize(
    "extra, field",
    [
        (
            {"response_format": json_schema_format({"type": "strnig"})},
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": ["a", 3]}, "guided_choice"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
        ({"guided_json": SCHEMA, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_unusable_constraints_are_400_naming_the_field(api, model, extra, field):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model, prompt="x", max_tokens=5, extra_body=extra)
    assert field in str(e.value)


def test_grpc_structured_output_and_its_invalid_argument(shared_server, tokenizer):
    import grpc

    from pdserve.cli.client import Client, generate_request
    from pdserve.v1 import generation_pb2

    request = generate_request([0, 9, 10], max_tokens=20, temperature=1.0, seed=2)
    request.sampling_params.structured_output.kind = "regex"
    request.sampling_params.structured_output.text = "[0-9]{4}"
    with Client(shared_server.address) as client:
        chunks = list(client.generate(request, timeout_s=60))
        ids = [t for c in chunks for t in c.token_ids]
        assert re.fullmatch("[0-9]{4}", tokenizer.decode(ids))
        assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_STOP
        request.sampling_params.structured_output.kind = "xml"
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate(request, timeout_s=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling_params.structured_output.kind" in e.value.details()
