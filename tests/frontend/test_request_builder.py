"""The one request builder both front ends call, without Ray: a GenerateRequest and an OpenAI body that ask for
the same thing build the same checked request, and one fault is named by each protocol's own field.
(Through the servers: test_generate.py and test_openai_http.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cli.client import generate_request
from pdserve.cluster.config import RouterConfig
from pdserve.frontend.grpc_service import _request_input
from pdserve.frontend.openai_api import CHAT, COMPLETIONS, parse
from pdserve.frontend.request_builder import build_request
from pdserve.frontend.validation import ModelInfo
from pdserve.model.errors import InvalidRequestError
from pdserve.model.tokenizer import THINK_END
from pdserve.v1 import generation_pb2


@pytest.fixture(scope="module")
def model(model_dir) -> ModelInfo:
    return ModelInfo.load(model_dir, "tiny")


def test_both_front_ends_build_the_same_request(model):
    sampling = {"max_tokens": 5, "temperature": 0.5, "seed": 3, "logprobs": 2}
    grpc_input = _request_input(
        generate_request("a cat sat", request_id="r1", n=2, stop=["x"], **sampling), 7.0
    )
    http_input = parse({"prompt": "a cat sat", "n": 2, "stop": "x", **sampling}, COMPLETIONS).input
    from_grpc = build_request(grpc_input, model, RouterConfig())
    from_http = build_request(http_input, model, RouterConfig())
    assert from_grpc.prompt_ids == from_http.prompt_ids == model.tokenizer.encode("a cat sat")
    assert from_grpc.params == from_http.params
    assert from_grpc.params.max_tokens == 5 and from_grpc.params.logprobs == 2
    assert from_grpc.stop == from_http.stop == ("x",) and from_grpc.n == from_http.n == 2
    assert (from_grpc.client_id, from_grpc.deadline) == ("r1", 7.0)


def test_a_chat_prompt_is_rendered_without_a_second_bos(model):
    messages = [{"role": "user", "content": "hi"}]
    checked = build_request(parse({"messages": messages}, CHAT).input, model, RouterConfig())
    text = model.chat_template.render(messages, True, {})
    assert checked.prompt_ids == model.tokenizer.encode(text, add_bos=False)


FAULTS = [
    # (what, GenerateRequest, OpenAI completions body, gRPC field, HTTP field)
    ("token id outside vocab", generate_request([0, 1024]), {"prompt": [0, 1024]},
     "prompt_token_ids", "prompt"),
    ("max_tokens above context", generate_request([0, 1], max_tokens=5000),
     {"prompt": [0, 1], "max_tokens": 5000}, "sampling_params.max_tokens", "max_tokens"),
    ("top_p 0", generate_request([0, 1], top_p=0.0), {"prompt": [0, 1], "top_p": 0.0},
     "sampling_params.top_p", "top_p"),
    ("stop id outside vocab", generate_request([0], stop_token_ids=[5000]),
     {"prompt": [0], "stop_token_ids": [5000]}, "sampling_params.stop_token_ids", "stop_token_ids"),
    ("logprobs above the limit", generate_request([0], logprobs=21), {"prompt": [0], "logprobs": 21},
     "sampling_params.logprobs", "logprobs"),
    ("n above the limit", generate_request([0], n=17), {"prompt": [0], "n": 17},
     "sampling_params.n", "n"),
    ("empty stop string", generate_request([0], stop=[""]), {"prompt": [0], "stop": [""]},
     "sampling_params.stop", "stop"),
    ("seed past the engine's", generate_request([0], seed=2**64 - 1), {"prompt": [0], "seed": 2**64 - 1},
     "sampling_params.seed", "seed"),
    ("top_k below -1", generate_request([0], top_k=-2), {"prompt": [0], "top_k": -2},
     "sampling_params.top_k", "top_k"),
]  # fmt: skip


@pytest.mark.parametrize(
    "request_, body, grpc_field, http_field", [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS]
)
def test_a_fault_is_named_in_each_protocols_own_field(
    model, request_, body, grpc_field, http_field
):
    errors = []
    for given in (_request_input(request_, None), parse(body, COMPLETIONS).input):
        with pytest.raises(InvalidRequestError) as e:
            build_request(given, model, RouterConfig())
        errors.append(e.value)
    assert [e.field for e in errors] == [grpc_field, http_field]
    # The same check refused both: only the field's name differs.
    assert str(errors[0]).removeprefix(f"{grpc_field}: ") == str(errors[1]).removeprefix(
        f"{http_field}: "
    )


def test_advice_names_how_each_protocol_takes_token_ids(model):
    with pytest.raises(
        InvalidRequestError, match=r"missing: set prompt \(text\) or prompt_token_ids"
    ):
        build_request(_request_input(generation_pb2.GenerateRequest(), None), model, RouterConfig())
    no_tokenizer = dataclasses.replace(model, tokenizer=None)
    for given, advice in [
        (_request_input(generate_request("hi"), None), "send prompt_token_ids instead"),
        (parse({"prompt": "hi"}, COMPLETIONS).input, "send prompt as token ids instead"),
    ]:
        with pytest.raises(InvalidRequestError, match=advice) as e:
            build_request(given, no_tokenizer, RouterConfig())
        assert e.value.field == "prompt"


def test_relaxed_acceptance_carries_the_think_ids_from_both_front_ends(model, tmp_path):
    grpc_input = _request_input(generate_request([3, 4], relaxed_acceptance=True), None)
    http_input = parse({"prompt": [3, 4], "relaxed_acceptance": True}, COMPLETIONS).input
    from_grpc = build_request(grpc_input, model, RouterConfig())
    from_http = build_request(http_input, model, RouterConfig())
    assert model.thinks
    think = (model.tokenizer.token_id("<think>"), model.tokenizer.token_id("</think>"))
    assert from_grpc.params.relaxed_think_ids == from_http.params.relaxed_think_ids == think
    plain = build_request(_request_input(generate_request([3, 4]), None), model, RouterConfig())
    assert plain.params.relaxed_think_ids is None
    # a model without a think block refuses it, naming the field
    no_think = dataclasses.replace(model, thinks=False)
    with pytest.raises(InvalidRequestError) as e:
        build_request(grpc_input, no_think, RouterConfig())
    assert e.value.field == "sampling_params.relaxed_acceptance"
    with pytest.raises(InvalidRequestError, match="relaxed_acceptance"):
        parse({"prompt": [3], "relaxed_acceptance": "yes"}, COMPLETIONS)


def test_a_chat_prompt_says_whether_it_opened_a_think_block(model):
    """The tiny model's template thinks only when asked (`thinking`, as DeepSeek-V3.1's): only then does the
    output start as reasoning; a completions prompt never does, whatever its text."""
    messages = [{"role": "user", "content": "hi <think>"}]

    def built(body: dict, kind: str = CHAT):
        return build_request(parse(body, kind).input, model, RouterConfig())

    assert not built({"messages": messages}).prompt_in_think
    thinking = {"messages": messages, "chat_template_kwargs": {"thinking": True}}
    assert built(thinking).prompt_in_think
    assert not built({"prompt": "<think> a"}, COMPLETIONS).prompt_in_think


def test_a_constraint_starts_after_the_think_block_the_prompt_opened(model):
    """A constrained chat request whose prompt opens a think block is constrained after `</think>`; without
    thinking, for a completions prompt, and on a server with reasoning_parser 'none', from the first token. A
    gRPC request says where itself."""
    think_end = model.tokenizer.token_id(THINK_END)
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_object"},
    }

    def start_after(body: dict, kind: str = CHAT) -> int | None:
        return build_request(
            parse(body, kind).input, model, RouterConfig()
        ).params.structured.start_after

    thinking = {**body, "chat_template_kwargs": {"thinking": True}}
    assert start_after(thinking) == think_end
    assert start_after(body) is None
    # a server that splits no reasoning off answers with one content: constrained from the first token
    no_split = RouterConfig(reasoning_parser="none")
    assert (
        build_request(parse(thinking, CHAT).input, model, no_split).params.structured.start_after
        is None
    )
    assert start_after({"prompt": "<think> a", "guided_regex": "[a-z]+"}, COMPLETIONS) is None
    request = generate_request([0, 5], max_tokens=4)
    request.sampling_params.structured_output.kind = "regex"
    request.sampling_params.structured_output.text = "[a-z]+"
    request.sampling_params.structured_output.start_after_token_id = think_end
    built = build_request(_request_input(request, None), model, RouterConfig())
    assert built.params.structured.start_after == think_end
    request.sampling_params.structured_output.start_after_token_id = 5000
    with pytest.raises(InvalidRequestError) as e:
        build_request(_request_input(request, None), model, RouterConfig())
    assert e.value.field == "sampling_params.structured_output.start_after_token_id"


def test_a_list_of_prompts_builds_one_request_per_prompt_with_its_own_field(model):
    request = parse({"prompt": ["a cat", [0, 5, 6]], "n": 2, "max_tokens": 3}, COMPLETIONS)
    built = [build_request(g, model, RouterConfig()) for g in request.inputs]
    assert [b.prompt_ids for b in built] == [model.tokenizer.encode("a cat"), [0, 5, 6]]
    assert all(b.n == 2 and b.params.max_tokens == 3 for b in built)
    bad = parse({"prompt": ["a", [0, 5000]]}, COMPLETIONS).inputs[1]
    with pytest.raises(InvalidRequestError) as e:
        build_request(bad, model, RouterConfig())
    assert e.value.field == "prompt[1]"
