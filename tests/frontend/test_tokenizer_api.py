"""vLLM's tokenizer endpoints on the shared tiny server (what lm-eval's remote tokenizer calls): /tokenize gives the
ids a completions or chat request runs (its usage counts them, the tools a chat describes included), /detokenize
inverts it, /tokenizer_info names the special tokens and the chat template; bad input is a 400 naming the field,
another model's name a 404. (lm-eval itself on them: test_third_party_clients.py.)"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from serving import SHARED_PROMPT_BYTES

from pdserve.model.tokenizer import BOS_TOKEN, EOS_TOKEN


class Http:
    """Plain requests to the server's root (the tokenizer endpoints are not under /v1)."""

    def __init__(self, root: str):
        self.root = root

    def request(
        self, method: str, path: str, body=None, raw: bytes | None = None
    ) -> tuple[int, dict]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        request = urllib.request.Request(self.root + path, data=data, method=method)
        request.add_header("content-type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")


@pytest.fixture(scope="module")
def http(shared_server):
    return Http(shared_server.http_url.removesuffix("/v1"))


def post(http, path: str, body: dict) -> dict:
    status, reply = http.request("POST", path, body)
    assert status == 200, reply
    return reply


def test_tokenize_gives_the_ids_completions_run(http, api, model, tokenizer):
    text = "Question: which colour is the sky?"
    got = post(http, "/tokenize", {"model": model, "prompt": text})
    assert got["tokens"] == tokenizer.encode(text) and got["tokens"][0] == tokenizer.bos_id
    assert got["count"] == len(got["tokens"]) and got["token_strs"] is None
    assert got["max_model_len"] > got["count"]
    reply = api.completions.create(model=model, prompt=text, max_tokens=1)
    assert reply.usage.prompt_tokens == got["count"]
    plain = post(
        http, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}
    )
    assert plain["tokens"] == got["tokens"][1:]
    assert "".join(plain["token_strs"]).replace("Ġ", " ") == text  # byte-level pieces, spaces as Ġ


def test_tokenize_renders_messages_as_chat_completions_do(http, api, model, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    got = post(http, "/tokenize", {"model": model, "messages": messages})
    assert got["tokens"][0] == tokenizer.bos_id and got["tokens"][1] != tokenizer.bos_id
    reply = api.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == got["count"]
    opened = post(http, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert got["tokens"][: opened["count"]] == opened["tokens"] and opened["count"] < got["count"]


def test_tokenize_counts_the_tools_a_chat_request_describes(http, api, model):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = post(http, "/tokenize", {"messages": messages})
    got = post(http, "/tokenize", {"messages": messages, "tools": [tool]})
    assert got["count"] > plain["count"]
    reply = api.chat.completions.create(model=model, messages=messages, tools=[tool], max_tokens=1)
    assert reply.usage.prompt_tokens == got["count"]


def test_detokenize_inverts_tokenize_with_special_tokens_kept(http, model, tokenizer):
    text = "The quick brown fox"
    ids = post(http, "/tokenize", {"prompt": text})["tokens"]
    assert post(http, "/detokenize", {"model": model, "tokens": ids}) == {
        "prompt": BOS_TOKEN + text
    }


def test_tokenizer_info_names_the_special_tokens_and_the_template(http, shared_server):
    status, info = http.request("GET", "/tokenizer_info")
    assert status == 200
    assert (info["bos_token"], info["eos_token"]) == (BOS_TOKEN, EOS_TOKEN)
    assert info["chat_template"] == shared_server.server.model.chat_template.source
    assert info["add_bos_token"] is True and info["model_max_length"] > 0


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": [{"content": "no role"}]}, "messages[0]"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": 3}, "tools"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": 1},
            "add_generation_prompt",
        ),
        ("/tokenize", {"prompt": "x" * (SHARED_PROMPT_BYTES + 1)}, "prompt"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [1] * 100_000}, "tokens"),
        ("/detokenize", {"tokens": []}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    status, reply = http.request("POST", path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param


def test_another_model_s_name_is_a_404_and_a_body_not_an_object_a_400(http):
    status, reply = http.request("POST", "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404 and "not served here" in reply["error"]["message"]
    assert http.request("POST", "/detokenize", [1, 2])[0] == 400
    assert http.request("POST", "/tokenize", raw=b"{not json")[0] == 400
    assert http.request("GET", "/tokenize")[0] == 405
