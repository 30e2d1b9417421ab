"""The OpenAI-compatible HTTP API end to end on CPU, through the official `openai` client: a real `PdServer` (one
prefill and one decode worker as Ray actors) serving gRPC and HTTP side by side. Greedy outputs equal the offline
path's for the same prompt tokens, streamed or whole; usage counts right; chat prompts are the checkpoint's
template as transformers renders and tokenizes it; reasoning is split from content; a client that disconnects
mid-stream frees its pages on both workers; bad parameters are 400 naming them; /metrics parses with
prometheus-client's own parser, its counters move by what requests did, and the Grafana dashboard reads only
metrics it has."""

from __future__ import annotations

import http.client
import json
import logging
import pathlib
import re
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import torch
from serving import SHARED_PROMPT_BYTES, scrape, wait_for
from transformers import AutoTokenizer

from pdserve.cli.client import Client, generate_request
from pdserve.kernels import batch_invariant
from pdserve.model.tokenizer import THINK_END, THINK_START, Tokenizer
from pdserve.v1 import generation_pb2

PROMPT_BYTES = SHARED_PROMPT_BYTES


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.address) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def chat_ids(model_dir):
    """A chat prompt's token ids as transformers templates and tokenizes it."""
    hf = AutoTokenizer.from_pretrained(str(model_dir))

    def ids(messages, **kwargs) -> list[int]:
        text = hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
        return hf(text, add_special_tokens=False)["input_ids"]

    return ids


def model_name(server) -> str:
    return server.server.model.name


def greedy(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}


def all_pages_free(client: Client) -> bool:
    status = client.status()
    used = [w.kv_pages_used for pool in status.pools for w in pool.workers]
    return status.num_requests == 0 and not any(used)


def test_models_health_and_version(server, api):
    assert [m.id for m in api.models.list().data] == [model_name(server)]
    root = server.http_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/health", timeout=10) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(f"{root}/version", timeout=10) as reply:
        assert "version" in json.loads(reply.read())


def test_completion_from_token_ids_equals_offline(server, api, reference, tokenizer):
    prompt = [0, *range(40, 70)]
    expected = reference(prompt, 12)
    reply = api.completions.create(model=model_name(server), prompt=prompt, **greedy(12))
    (choice,) = reply.choices
    assert choice.text == tokenizer.decode(expected)
    assert choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 12)
    assert reply.usage.total_tokens == len(prompt) + 12
    assert reply.usage.model_extra["stage_times"]["decode_queue_s"] > 0


def test_streamed_text_completion_equals_offline_with_usage(server, api, reference, tokenizer):
    text = "The quick brown fox"
    prompt = tokenizer.encode(text)
    expected = reference(prompt, 10)
    stream = api.completions.create(
        model=model_name(server), prompt=text, stream=True,
        stream_options={"include_usage": True}, **greedy(10),
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(expected)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    *body, last = chunks
    assert not last.choices and all(c.usage is None for c in body)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 10)
    stages = last.usage.model_extra["stage_times"]  # pdserve's own key: the request's stage times
    assert list(stages) == [
        "router_queue_s", "prefill_queue_s", "prefill_s", "kv_transfer_s", "decode_queue_s",
        "time_to_first_token_s",
    ]  # fmt: skip
    assert all(0 < v < stages["time_to_first_token_s"] for k, v in stages.items() if "prefill" in k)


def test_chat_whole_and_streamed_equal_offline(server, api, reference, tokenizer, chat_ids):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    prompt = chat_ids(messages)
    expected = tokenizer.decode(reference(prompt, 16))
    reply = api.chat.completions.create(model=model_name(server), messages=messages, **greedy(16))
    (choice,) = reply.choices
    message = choice.message
    assert message.role == "assistant" and choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 16)
    # The tiny model's template thinks only when asked: the answer is content (a random model may still
    # write think tags into it: only a block the output opens itself would be reasoning).
    assert not expected.startswith(THINK_START)
    assert (message.content, message.reasoning_content, message.reasoning) == (expected, None, None)

    stream = api.chat.completions.create(
        model=model_name(server), messages=messages, stream=True,
        stream_options={"include_usage": True}, **greedy(16),
    )  # fmt: skip
    chunks = list(stream)
    first = chunks[0].choices[0].delta
    assert first.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    streamed_content = "".join(d.content or "" for d in deltas)
    assert (streamed_reasoning, streamed_content) == (
        message.reasoning_content or "",
        message.content or "",
    )
    assert chunks[-1].usage.completion_tokens == 16


def test_reasoning_and_content_split_in_whole_and_streamed_replies(
    server, api, reference, tokenizer, chat_ids
):
    # Asked to think, the template opens a think block: until the model closes it, its text is reasoning.
    # Random weights close it only for some prompts: find one among a few questions.
    questions = [
        [{"role": "user", "content": f"Question {i}: what is {i}+{i}?"}] for i in range(32)
    ]
    thinking = {"chat_template_kwargs": {"thinking": True}, "ignore_eos": True}

    def ask(messages):
        return api.chat.completions.create(
            model=model_name(server), messages=messages, max_tokens=24, temperature=0,
            extra_body=thinking,
        )  # fmt: skip

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, questions))
    found = [
        (q, r) for q, r in zip(questions, replies, strict=True) if r.choices[0].message.content
    ]
    assert found, "no question made the tiny model close its think block"
    unclosed = [r for r in replies if not r.choices[0].message.content]
    assert unclosed, "every question made the tiny model close its think block"
    message = unclosed[0].choices[0].message
    assert message.reasoning_content and message.reasoning == message.reasoning_content
    messages, reply = found[0]
    expected = tokenizer.decode(reference(chat_ids(messages, thinking=True), 24))
    reasoning, closed, content = expected.partition(THINK_END)
    assert closed
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning or None, content)
    assert THINK_END not in message.content + (message.reasoning_content or "")

    stream = api.chat.completions.create(
        model=model_name(server), messages=messages, stream=True, max_tokens=24, temperature=0,
        extra_body=thinking,
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed_reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    streamed_content = "".join(d.content or "" for d in deltas)
    assert (streamed_reasoning, streamed_content) == (reasoning, content)
    # Reasoning comes first, then content: no delta after the one where content began carries reasoning
    # (that one may carry both: a chunk holds every token the client had not read yet).
    began = [i for i, d in enumerate(deltas) if d.content]
    assert not any(getattr(d, "reasoning", None) for d in deltas[began[0] + 1 :])


def test_disconnect_mid_stream_frees_pages_on_both_workers(server, api, grpc_client, caplog):
    caplog.set_level(logging.INFO)
    # two choices: the disconnect ends both
    stream = api.completions.create(
        model=model_name(server), prompt=[0, *range(10, 200)], stream=True, n=2, **greedy(3000)
    )
    chunks = iter(stream)
    for _ in range(4):
        assert next(chunks).choices[0].finish_reason is None
    status = grpc_client.status()
    held = {w.worker_id: w.kv_pages_used for pool in status.pools for w in pool.workers}
    assert status.num_requests == 2 and held["decode-0"] > 0, held
    stream.close()
    wait_for(lambda: all_pages_free(grpc_client), 10, "pages freed after the client disconnected")
    # One INFO line for the disconnect, no traceback.
    gone = [
        r for r in caplog.records if "cancelled: the HTTP client disconnected" in r.getMessage()
    ]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_disconnect_during_prefill_frees_pages_on_both_workers(server, api, grpc_client, caplog):
    # About half a second of prefill on a CPU: the response has not started when the client leaves.
    caplog.set_level(logging.INFO, logger="pdserve.frontend.http_server")
    prompt = [0, *[(7 * i) % 900 + 3 for i in range(2000)]]
    body = {"model": model_name(server), "prompt": prompt, "max_tokens": 2000, "stream": True}
    url = urllib.parse.urlsplit(server.http_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    connection.request(
        "POST", f"{url.path}/completions", json.dumps(body), {"content-type": "application/json"}
    )

    def pages_in_use() -> dict[str, int]:
        return {w.worker_id: w.kv_pages_used for p in grpc_client.status().pools for w in p.workers}

    held = wait_for(
        lambda: (p := pages_in_use())["prefill-0"] > 0 and p, 30,
        "the prompt on the prefill worker", interval_s=0.01,
    )  # fmt: skip
    assert held["decode-0"] > 0, held
    connection.close()
    wait_for(lambda: all_pages_free(grpc_client), 5, "pages freed after a disconnect in prefill")
    assert "cancelled: the HTTP client disconnected" in caplog.text  # before its first chunk
    reply = api.completions.create(model=model_name(server), prompt=[0, 1, 2], **greedy(2))
    assert reply.choices[0].finish_reason == "length"  # still serving


@pytest.mark.parametrize(
    "params, param",
    [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"stop": ["x"] * 33}, "stop"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"skip_special_tokens": "no"}}, "skip_special_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 2, "extra_body": {"min_tokens": 3}}, "min_tokens"),
        ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
    ],
)
def test_bad_chat_parameter_is_400_naming_it(server, api, params, param):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(
            model=model_name(server), messages=[{"role": "user", "content": "hi"}], **params
        )
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def token_id(text: str) -> int:
    return int(text.removeprefix("token_id:"))


def test_logprobs_are_the_model_s_log_softmax_whole_and_streamed(
    server, api, reference, reference_logits, tokenizer, chat_ids
):
    # sampled, whole: the first token comes from the prefill worker, the others from the decode worker
    prompt = [0, *range(100, 130)]
    reply = api.completions.create(
        model=model_name(server), prompt=prompt, logprobs=3, seed=5, temperature=0.9,
        max_tokens=4, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    (choice,) = reply.choices
    tokens = [token_id(t) for t in choice.logprobs.tokens]
    assert choice.text == tokenizer.decode(tokens) and len(tokens) == 4
    expected = torch.log_softmax(reference_logits(prompt, tokens), -1)  # [5, V]
    for i, token in enumerate(tokens):
        assert choice.logprobs.token_logprobs[i] == pytest.approx(
            expected[i, token].item(), abs=1e-4
        )
        top = {token_id(t): v for t, v in choice.logprobs.top_logprobs[i].items()}
        assert set(top) == set(expected[i].topk(3).indices.tolist()) | {token}
        assert all(v == pytest.approx(expected[i, t].item(), abs=1e-4) for t, v in top.items())
    # greedy chat, streamed: each chunk carries its tokens' entries
    messages = [{"role": "user", "content": "Name a colour."}]
    stream = api.chat.completions.create(
        model=model_name(server), messages=messages, logprobs=True, top_logprobs=2,
        max_completion_tokens=4, stream=True, temperature=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    entries = [e for c in stream if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]  # fmt: skip
    prompt = chat_ids(messages)
    tokens = [token_id(e.token) for e in entries]
    assert tokens == reference(prompt, 4)
    expected = torch.log_softmax(reference_logits(prompt, tokens), -1)
    for i, e in enumerate(entries):
        assert e.logprob == pytest.approx(expected[i, tokens[i]].item(), abs=1e-4)
        values, ids = expected[i].topk(2)
        assert [token_id(t.token) for t in e.top_logprobs] == ids.tolist()
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)


def test_penalized_greedy_equals_the_formula_on_the_model_s_logits(server, api, reference_logits):
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    # a negative presence penalty draws the output back to its own tokens, the frequency penalty away again
    penalties = {"presence_penalty": -2.0, "frequency_penalty": 1.0}
    expected: list[int] = []
    moved = 0  # steps where the penalties change the greedy choice
    for _ in range(6):
        logits = reference_logits(prompt, expected)[-1]  # [V]
        # Hugging Face's repetition penalty over prompt + output, then OpenAI's over the output
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt + expected] = True
        penalized = torch.where(seen, torch.where(logits > 0, logits / 0.8, logits * 0.8), logits)
        counts = torch.bincount(torch.tensor(expected, dtype=torch.long), minlength=logits.numel())
        penalized = penalized - 1.0 * counts + 2.0 * (counts > 0).float()
        expected.append(int(penalized.argmax()))
        moved += expected[-1] != int(logits.argmax())
    assert moved > 0
    reply = api.completions.create(
        model=model_name(server), prompt=prompt, max_tokens=6, temperature=0, **penalties,
        extra_body={"ignore_eos": True, "repetition_penalty": 0.8, "return_tokens_as_token_ids": True},
        logprobs=0,
    )  # fmt: skip
    assert [token_id(t) for t in reply.choices[0].logprobs.tokens] == expected


def test_n_choices_are_seeded_reproducible_and_streamed_by_index(server, api, grpc_client):
    sampled = {"temperature": 1.0, "seed": 42, "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    prompt = [0, *range(200, 220)]
    first = api.completions.create(model=model_name(server), prompt=prompt, n=2, **sampled)
    again = api.completions.create(model=model_name(server), prompt=prompt, n=2, **sampled)
    alone = api.completions.create(model=model_name(server), prompt=prompt, **sampled)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1] and texts[0] != texts[1]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert alone.choices[0].text == texts[0]  # choice 0 keeps the request's seed
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(prompt), 12)
    stream = api.completions.create(
        model=model_name(server), prompt=prompt, n=2, stream=True,
        stream_options={"include_usage": True}, **sampled,
    )  # fmt: skip
    streamed, finishes = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert streamed == texts and finishes == ["length", "length"]
    assert chunk.usage.completion_tokens == 12
    # gRPC: the chunks of both choices on one stream, each naming its index
    request = generate_request(
        prompt, max_tokens=6, temperature=1.0, seed=42, ignore_eos=True, n=2, logprobs=1
    )
    by_index: dict[int, list] = {0: [], 1: []}
    for reply in grpc_client.generate(request, timeout_s=60):
        assert len(reply.logprobs) == len(reply.token_ids)
        assert all(len(lp.top_token_ids) == 1 for lp in reply.logprobs)
        by_index[reply.index].append(reply)
    assert ["".join(r.text for r in by_index[i]) for i in (0, 1)] == texts
    assert [by_index[i][-1].usage.completion_tokens for i in (0, 1)] == [6, 6]


def test_context_overflow_states_the_limit_and_what_was_asked(server, api):
    limit = server.server.model.max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model_name(server), prompt=[0, 5, 6], max_tokens=limit)
    assert e.value.body["param"] == "max_tokens"
    message = e.value.body["message"]
    assert f"prompt (3 tokens) + max_tokens ({limit})" in message and f"{limit} tokens" in message


def test_unknown_model_is_404_and_the_server_keeps_serving(server, api, reference, tokenizer):
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4o", prompt=[0, 5], max_tokens=2)
    request = urllib.request.Request(
        f"{server.http_url}/completions", data=b"{not json", method="POST",
        headers={"content-type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "body"
    reply = api.completions.create(model=model_name(server), prompt=[0, 5, 6, 7], **greedy(4))
    assert reply.choices[0].text == tokenizer.decode(reference([0, 5, 6, 7], 4))


def test_stop_string_spanning_tokens_ends_the_text_before_it(
    server, api, grpc_client, reference, tokenizer
):
    prompt = [0, *range(100, 130)]
    ids = reference(prompt, 16)
    whole = tokenizer.decode(ids)
    # A stop string across the token boundary nearest the middle of the output.
    bounds = [
        b for k in range(1, len(ids)) if whole.startswith(text := tokenizer.decode(ids[:k]))
        and 2 <= (b := len(text)) <= len(whole) - 2
    ]  # fmt: skip
    b = min(bounds, key=lambda b: abs(b - len(whole) // 2))
    stop = whole[b - 2 : b + 2]
    expected = whole[: whole.find(stop)]
    assert len(expected) < len(whole)

    reply = api.completions.create(model=model_name(server), prompt=prompt, stop=stop, **greedy(16))
    (choice,) = reply.choices
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert reply.usage.completion_tokens < 16
    stream = api.completions.create(
        model=model_name(server), prompt=prompt, stop=[stop, "never there"], stream=True, **greedy(16)
    )  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == expected and chunks[-1].finish_reason == "stop"

    request = generate_request(prompt, max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    replies = list(grpc_client.generate(request, timeout_s=60))
    assert "".join(r.text for r in replies) == expected
    assert replies[-1].finish_reason == generation_pb2.FINISH_REASON_STOP
    # The workers were told to stop: the request's pages are freed.
    wait_for(lambda: all_pages_free(grpc_client), 10, "pages freed after a stop string")


def test_prompt_and_body_sizes_are_refused_naming_the_limit(server, api, grpc_client):
    text = "word " * (PROMPT_BYTES // 5 + 1)
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model_name(server), prompt=text, max_tokens=2)
    assert e.value.body["param"] == "prompt"
    assert f"at most {PROMPT_BYTES} (router.max_prompt_bytes)" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(
            model=model_name(server), messages=[{"role": "user", "content": text}], max_tokens=2
        )
    assert e.value.body["param"] == "messages"
    # A body declared too large is refused before it is read (so none is sent here).
    url = urllib.parse.urlsplit(server.http_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    connection.putrequest("POST", f"{url.path}/completions")
    connection.putheader("content-type", "application/json")
    connection.putheader("content-length", str(2 * PROMPT_BYTES + (1 << 20) + 1))
    connection.endheaders()
    reply = connection.getresponse()
    assert reply.status == 413 and json.loads(reply.read())["error"]["param"] == "body"
    connection.close()
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_client.generate(generate_request(text, max_tokens=2), timeout_s=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        e.value.details().startswith("prompt: ") and "router.max_prompt_bytes" in e.value.details()
    )


DASHBOARD = pathlib.Path(__file__).parents[2] / "deploy" / "grafana" / "pdserve.json"
# A histogram family's samples, and a counter's (the parser names a counter's family without its _total).
SAMPLE_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}


def metrics_url(server) -> str:
    return f"{server.http_url.removesuffix('/v1')}/metrics"


def value(families: dict, name: str, sample: str = "", **labels) -> float:
    """The one sample of family `name` (sample name `name + sample`) whose labels include `labels`."""
    (found,) = [
        s.value for s in families[name].samples
        if s.name == name + sample and labels.items() <= s.labels.items()
    ]  # fmt: skip
    return found


def test_metrics_count_what_http_and_grpc_requests_did(server, api, grpc_client):
    model = model_name(server)
    before = scrape(metrics_url(server))
    histograms = (
        "pdserve:time_to_first_token_seconds",
        "pdserve:e2e_request_latency_seconds",
        "pdserve:request_queue_time_seconds",
        "pdserve:inter_token_latency_seconds",
    )

    def moved(families, name, sample="", **labels):
        return value(families, name, sample, **labels) - value(before, name, sample, **labels)

    whole = api.completions.create(model=model, prompt=[0, *range(20, 45)], **greedy(6))
    stream = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count."}], stream=True,
        stream_options={"include_usage": True}, **greedy(5),
    )  # fmt: skip
    streamed = list(stream)[-1].usage
    http_usage = [whole.usage, streamed]
    middle = scrape(metrics_url(server))
    # One observation per step after the first: at least one each (several tokens), at most one per token.
    itl = moved(middle, histograms[3], "_count")
    assert 2 <= itl <= sum(u.completion_tokens - 1 for u in http_usage)

    prompt = [0, *range(300, 340)]
    replies = list(grpc_client.generate(generate_request(prompt, max_tokens=7, ignore_eos=True)))
    steps = [r for r in replies if r.token_ids]
    after = scrape(metrics_url(server))

    prompt_tokens = sum(u.prompt_tokens for u in http_usage) + len(prompt)
    generated = sum(u.completion_tokens for u in http_usage) + 7
    assert moved(after, "pdserve:prompt_tokens", "_total", model_name=model) == prompt_tokens
    assert moved(after, "pdserve:generation_tokens", "_total", model_name=model) == generated
    success = "pdserve:request_success"
    assert moved(after, success, "_total", finished_reason="length") == 3
    assert moved(after, success, "_total", finished_reason="stop") == 0
    assert moved(after, success, "_total", finished_reason="abort") == 0
    for name in histograms[:3]:
        assert moved(after, name, "_count") == 3, name
    assert moved(after, histograms[3], "_count") - itl == len(steps) - 1
    # Each request's end-to-end time covers its time to first token, which covers its queue time.
    ttft, e2e, queued = (moved(after, name, "_sum") for name in histograms[:3])
    assert e2e > ttft > queued >= 0
    # Disaggregated: each of the three was prefilled on the prefill worker and its KV sent.
    for name in ("pdserve:request_prefill_time_seconds", "pdserve:kv_transfer_seconds"):
        assert moved(after, name, "_count") == 3, name

    # The workers' own figures, one series per worker, from stats the server polls each second.
    def workers_seen():
        families = scrape(metrics_url(server))
        seen = {s.labels["worker"] for s in families["pdserve:kv_cache_usage_perc"].samples}
        return seen == {"prefill-0", "decode-0"} and families

    after = wait_for(workers_seen, 10, "every worker's KV cache usage in /metrics")
    for worker in ("prefill-0", "decode-0"):
        assert 0 <= value(after, "pdserve:kv_cache_usage_perc", worker=worker) <= 1
    assert value(after, "pdserve:num_requests_running", worker="decode-0") >= 0
    assert value(after, "pdserve:num_preemptions", "_total", worker="decode-0") >= 0
    assert value(after, "pdserve:prefill_queue_tokens", worker="prefill-0") >= 0
    assert value(after, "pdserve:kv_transfer_bytes", "_total", worker="prefill-0") > 0
    assert value(after, "pdserve:kv_transfer_failures", "_total", worker="prefill-0") == 0

    # A long request shows on its decode worker's gauges; a client that leaves mid-stream counts as
    # finished with abort.
    aborted = value(after, success, "_total", finished_reason="abort")
    replies = grpc_client.generate(generate_request(prompt, max_tokens=3000, ignore_eos=True))
    next(replies), next(replies)

    def decoding():
        families = scrape(metrics_url(server))
        running = value(families, "pdserve:num_requests_running", worker="decode-0")
        return (
            running == 1 and value(families, "pdserve:kv_cache_usage_perc", worker="decode-0") > 0
        )

    wait_for(decoding, 10, "the running request in decode-0's gauges")
    replies.cancel()

    def abort_counted():
        families = scrape(metrics_url(server))
        return (
            value(families, success, "_total", finished_reason="abort") == aborted + 1 and families
        )

    settled = wait_for(abort_counted, 10, "the cancelled request counted as abort")

    # The metrics-only port serves the same registry, and nothing else.
    port = server.server.metrics_port
    assert port and port != server.server.http_port
    alone = scrape(f"http://127.0.0.1:{port}/metrics")
    assert value(alone, "pdserve:generation_tokens", "_total") == value(
        settled, "pdserve:generation_tokens", "_total"
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
    assert e.value.code == 404


def test_a_prompt_sent_again_finds_its_pages_in_the_prefix_cache(server, api, grpc_client):
    """The prefill worker's prefix cache: a prompt sent again has its full pages (within all but its last
    token) found cached, as usage.prompt_tokens_details.cached_tokens says on both front ends, streamed or
    whole, with the tokens it had the first time; the worker's prefix-cache counters count them."""
    model = model_name(server)
    g = torch.Generator().manual_seed(45)
    prompt = [0, *torch.randint(3, 1000, (200,), generator=g).tolist()]  # 201 tokens
    # a hit is whole pages (64 tokens), in batch-invariant mode whole prefill chunks (128 tokens)
    unit = 128 if batch_invariant() else 64
    hit = (len(prompt) - 1) // unit * unit
    first = api.completions.create(model=model, prompt=prompt, **greedy(4))
    second = api.completions.create(model=model, prompt=prompt, **greedy(4))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == hit
    assert second.choices[0].text == first.choices[0].text
    stream = api.completions.create(
        model=model, prompt=prompt, stream=True, stream_options={"include_usage": True},
        **greedy(4),
    )  # fmt: skip
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens == hit
    replies = list(grpc_client.generate(generate_request(prompt, max_tokens=4, ignore_eos=True)))
    assert replies[-1].usage.cached_tokens == hit

    def counted():  # the stats polled after the four requests
        families = scrape(metrics_url(server))
        hits = [
            s.value for s in families["pdserve:prefix_cache_hits"].samples
            if s.labels["worker"] == "prefill-0"
        ]  # fmt: skip
        return hits and hits[0] >= 3 * hit and families

    families = wait_for(counted, 10, "the prefill worker's prefix-cache hits in /metrics")
    queries = value(families, "pdserve:prefix_cache_queries", "_total", worker="prefill-0")
    assert queries >= 4 * len(prompt)


def test_dashboard_uses_only_metrics_the_server_exposes(server):
    dashboard = json.loads(DASHBOARD.read_text())
    families = scrape(metrics_url(server))
    exposed = {
        family.name + suffix
        for family in families.values()
        for suffix in SAMPLE_SUFFIXES.get(family.type, ("",))
    }
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert len(queries) >= 10
    used = set()
    for query in queries:
        names = set(re.findall(r"pdserve:[A-Za-z0-9_:]+", query))
        assert names, f"a query reads no pdserve metric: {query}"
        used |= names
    assert used <= exposed, sorted(used - exposed)
    # The latencies, throughput, queues and KV usage are all on it.
    for name in (
        "pdserve:time_to_first_token_seconds_bucket", "pdserve:inter_token_latency_seconds_bucket",
        "pdserve:e2e_request_latency_seconds_bucket", "pdserve:generation_tokens_total",
        "pdserve:prompt_tokens_total", "pdserve:num_requests_running",
        "pdserve:num_requests_waiting", "pdserve:kv_cache_usage_perc",
    ):  # fmt: skip
        assert name in used, name


def test_eval_scores_the_builtin_task_through_the_api(
    server, reference, tokenizer, tmp_path, capsys
):
    from pdserve.cli.evaluate import STOP, completion_prompt, load_task
    from pdserve.cli.main import main

    out = tmp_path / "eval.json"
    argv = ["eval", "--base-url", server.http_url, "--max-tokens", "8", "--num-fewshot", "1"]
    assert main([*argv, "--concurrency", "4", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    printed = json.loads(capsys.readouterr().out)
    assert printed == {k: v for k, v in result.items() if k != "samples"}
    assert result["format"] == "pdserve-eval/1" and result["model"] == model_name(server)
    assert (result["task"], result["num_items"], result["num_errors"]) == ("gsm8k-mini", 20, 0)
    samples = result["samples"]
    assert [s["index"] for s in samples] == list(range(20))
    for name, key in (
        ("exact_match_strict", "correct_strict"),
        ("exact_match_flexible", "correct_flexible"),
    ):
        metric = result["metrics"][name]
        assert metric["num_correct"] == sum(s[key] for s in samples)
        assert metric["score"] == metric["num_correct"] / 20 and 0 <= metric["stderr"] <= 0.5
    assert result["score"] == result["metrics"]["exact_match_flexible"]["score"]
    # What the eval scored is the model's greedy answer to the prompt it says it sent, cut at a stop string.
    task = load_task("gsm8k-mini")
    for s in samples[:3]:
        ids = tokenizer.encode(completion_prompt(task, task.test[s["index"]], 1))
        text = tokenizer.decode(reference(ids, 8))
        cut = min((text.index(stop) for stop in STOP if stop in text), default=len(text))
        assert s["response"] == text[:cut]
        assert s["finish_reason"] == ("stop" if cut < len(text) else "length")

    chat = [*argv, "--api", "chat", "--limit", "2", "--max-tokens", "4"]
    assert main(chat) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["api"], result["num_items"], result["num_errors"]) == ("chat", 2, 0)
