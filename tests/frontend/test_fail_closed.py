"""Bad input fails closed on the shared server, in both front ends: text with lone surrogates, JSON nested past
`MAX_JSON_DEPTH`, integers past their field's range, unknown paths and methods, and a client that leaves
mid-body each get a 4xx (HTTP: with an OpenAI-shaped body naming the field; gRPC: INVALID_ARGUMENT naming it)
and nothing logged at ERROR; the server goes on serving."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
import urllib.parse

import grpc
import openai
import pytest

from pdserve.cli.client import Client, generate_request
from pdserve.frontend.json_body import MAX_JSON_DEPTH
from pdserve.v1 import admin_pb2, generation_pb2


@pytest.fixture(scope="module")
def api(shared_server):
    return openai.OpenAI(
        base_url=shared_server.http_url, api_key="unused", max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def grpc_client(shared_server):
    with Client(shared_server.address) as client:
        yield client


@pytest.fixture
def errors_logged(caplog):
    """The records logged at ERROR or above while the test ran (any logger, any thread)."""
    caplog.set_level(logging.INFO)
    return lambda: [r for r in caplog.records if r.levelno >= logging.ERROR]


def post(server, path: str, raw: bytes) -> tuple[int, dict]:
    """POSTs raw bytes as JSON; (status, the decoded body)."""
    url = urllib.parse.urlsplit(server.http_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.request("POST", url.path + path, raw, {"content-type": "application/json"})
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


LONE = "\ud800"
"""A lone surrogate (json.dumps spells it `"\\ud800"`)."""
CHAT, COMPLETIONS = "/chat/completions", "/completions"
HI = [{"role": "user", "content": "hi"}]


def nested(levels: int) -> str:
    """`levels` arrays, one inside the other, as JSON."""
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(
    "path, body, param",
    [
        (COMPLETIONS, {"prompt": LONE}, "prompt"),
        (COMPLETIONS, {"prompt": f"a{LONE}b"}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": LONE, "content": "hi"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
         "messages[0].content[0].text"),
        (COMPLETIONS, {"prompt": "hi", LONE: 1}, "body"),
        (COMPLETIONS, {"prompt": "hi", "stream": True, "stream_options": {LONE: 1}},
         "stream_options"),
        (COMPLETIONS, {"prompt": "hi", "stop": [LONE]}, "stop[0]"),
        (COMPLETIONS, {"prompt": "hi", "user": LONE}, "user"),
        (COMPLETIONS, {"prompt": "hi", "model": LONE}, "model"),
        (COMPLETIONS, '{"prompt": "hi", "user": ' + nested(1000) + "}", "body"),
        (COMPLETIONS, '{"prompt": "hi", "user": ' + nested(MAX_JSON_DEPTH) + "}", "user"),
        (COMPLETIONS, '{"prompt": "hi", "seed": ' + "9" * 5000 + "}", "body"),
        (COMPLETIONS, {"prompt": "hi", "top_k": 2**64}, "top_k"),
        (COMPLETIONS, {"prompt": "hi", "top_k": 2**63}, "top_k"),
        (COMPLETIONS, {"prompt": "hi", "min_tokens": 2**64, "max_tokens": 2}, "min_tokens"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 2**64}, "logprobs"),
        (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": -(2**64)}, "top_logprobs"),
    ],
    ids=[
        "prompt", "prompt-inside", "content", "role", "content-part", "key", "nested-key", "stop",
        "user", "model", "nested-1000", "nested-past-limit", "integer-5000-digits", "top_k-2**64",
        "top_k-2**63", "min_tokens", "logprobs", "top_logprobs",
    ],
)  # fmt: skip
def test_bad_http_body_is_400_naming_the_field(shared_server, errors_logged, path, body, param):
    raw = body if isinstance(body, str) else json.dumps(body)
    status, reply = post(shared_server, path, raw.encode())
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"
    assert errors_logged() == []


def test_nesting_within_the_limit_is_served(shared_server):
    # The body, chat_template_kwargs and its "x" are 3 levels: the limit is reached, not passed.
    kwargs = '{"x": ' + nested(MAX_JSON_DEPTH - 2) + "}"
    body = (
        json.dumps({"messages": HI, "max_tokens": 1})[:-1] + ', "chat_template_kwargs": ' + kwargs
    )
    status, reply = post(shared_server, CHAT, (body + "}").encode())
    assert status == 200, reply


def test_integer_past_its_range_through_the_openai_client(api, shared_server, errors_logged):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(
            model=shared_server.server.model.name, prompt="hi", max_tokens=2,
            extra_body={"top_k": 2**64},
        )  # fmt: skip
    assert e.value.body["param"] == "top_k" and str(2**31 - 1) in e.value.body["message"]
    assert errors_logged() == []


def test_unknown_paths_and_methods_are_openai_shaped(shared_server):
    url = urllib.parse.urlsplit(shared_server.http_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]:
        connection.request(method, path)
        reply = connection.getresponse()
        assert reply.status == status
        assert reply.getheader("content-type") == "application/json"
        assert json.loads(reply.read())["error"]["message"]
    connection.close()


def test_a_client_that_leaves_mid_body_is_one_info_line(shared_server, api, caplog):
    caplog.set_level(logging.INFO)
    url = urllib.parse.urlsplit(shared_server.http_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b'content-length: 1000\r\n\r\n{"prompt": '
        )
    # The next request on the server is answered after the first's disconnect was handled.
    reply = api.completions.create(
        model=shared_server.server.model.name, prompt=[0, 5], max_tokens=1
    )
    assert reply.choices[0].finish_reason == "length"
    left = [r for r in caplog.records if "left before its" in r.getMessage()]
    assert len(left) == 1 and left[0].levelno == logging.INFO and left[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _raw_generate(client: Client):
    """Generate taking the request's bytes as they are (a client that builds its own messages)."""
    return client.channel.unary_stream(
        "/pdserve.v1.Generation/Generate",
        request_serializer=lambda b: b,
        response_deserializer=generation_pb2.GenerateResponse.FromString,
    )


def test_bad_grpc_request_is_invalid_argument_naming_the_field(grpc_client, errors_logged):
    request = generate_request([0, 5], max_tokens=2)
    request.sampling_params.seed = 2**64 - 1  # a uint64 past the engine's seeds
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_client.generate(request, timeout_s=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("sampling_params.seed: ")
    # A prompt holding a surrogate, as bytes (UTF-8 cannot spell one; protobuf refuses the message).
    text = generation_pb2.GenerateRequest(prompt="hi").SerializeToString()
    bad = text.replace(b"hi", b"\xed\xa0\x80")
    with pytest.raises(grpc.RpcError) as e:
        list(_raw_generate(grpc_client)(bad, metadata=grpc_client.metadata, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert errors_logged() == []


def test_a_body_that_breaks_http_mid_request_is_one_400_and_one_line(shared_server, caplog):
    caplog.set_level(logging.INFO)
    url = urllib.parse.urlsplit(shared_server.http_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
            b"zz\r\nnot a chunk size\r\n"
        )
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["message"]
    time.sleep(0.3)  # room for a second line (its handler's disconnect), which must not come
    lines = [r for r in caplog.records if r.name.startswith("pdserve.frontend")]
    assert [r.levelno for r in lines] == [logging.INFO], [r.getMessage() for r in lines]


def test_scaling_a_pool_past_any_cluster_is_invalid_argument(grpc_client):
    scale = grpc_client.channel.unary_unary(
        "/pdserve.v1.Admin/ScalePool",
        request_serializer=admin_pb2.ScalePoolRequest.SerializeToString,
        response_deserializer=admin_pb2.ScalePoolResponse.FromString,
    )
    request = admin_pb2.ScalePoolRequest(role=admin_pb2.ROLE_DECODE, count=2**32 - 1)
    with pytest.raises(grpc.RpcError) as e:
        scale(request, metadata=grpc_client.metadata, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("count: ")
