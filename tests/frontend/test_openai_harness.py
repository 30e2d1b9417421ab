"""The OpenAI HTTP API as evaluation harnesses and benchmark tools call it, through the official `openai` client on
the shared tiny server: a list of prompts in one completions request (lm-eval's batches) answers each prompt as a
request of its own would, choices prompt-major, usage summed, streamed too, and a client that leaves frees every
prompt's pages; `continuous_usage_stats` (guidellm) puts the usage so far in every chunk; OpenAI parameters that
vLLM ignores, and unknown ones, are ignored with a warning and a header naming them, while a known parameter with
a bad value is still a 400 naming it. (The tiny model's chat answers in `content`: test_openai_http.py.)"""

from __future__ import annotations

import logging
import uuid

import openai
import pytest
from serving import wait_for

from pdserve.cli.client import Client
from pdserve.frontend.openai_fields import IGNORED_HEADER
from pdserve.frontend.prompt_batch import MAX_PROMPTS


def greedy(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_a_list_of_token_id_prompts_answers_each_as_the_offline_path(
    api, model, reference, tokenizer
):
    prompts = [[0, *range(40, 60)], [0, *range(300, 310)], [0, 7, 8]]
    reply = api.completions.create(model=model, prompt=prompts, **greedy(5))
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, reply.choices, strict=True):
        assert choice.text == tokenizer.decode(reference(prompt, 5))
        assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == sum(map(len, prompts))
    assert reply.usage.completion_tokens == 15


def test_a_list_of_text_prompts_with_n_is_prompt_major_whole_and_streamed(api, model):
    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 4, "n": 2,
               "extra_body": {"ignore_eos": True}}  # fmt: skip
    prompts = ["The quick brown fox", "Once upon a time"]
    alone = [api.completions.create(model=model, prompt=p, **sampled) for p in prompts]
    expected = [c.text for r in alone for c in sorted(r.choices, key=lambda c: c.index)]
    reply = api.completions.create(model=model, prompt=prompts, **sampled)
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected
    assert reply.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert reply.usage.completion_tokens == 16
    stream = api.completions.create(
        model=model, prompt=prompts, stream=True, stream_options={"include_usage": True}, **sampled
    )  # fmt: skip
    texts, finishes = [""] * 4, [None] * 4
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == expected and finishes == ["length"] * 4
    assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (
        reply.usage.prompt_tokens, 16,
    )  # fmt: skip


def test_leaving_a_stream_of_several_prompts_frees_every_prompt_s_pages(shared_server, api, model):
    stream = api.completions.create(
        model=model, prompt=[[0, *range(10, 100)], [0, *range(200, 260)]], stream=True, n=2,
        **greedy(3000),
    )  # fmt: skip
    chunks = iter(stream)
    seen = set()
    while len(seen) < 4:  # every choice of both prompts under way
        seen |= {c.index for c in next(chunks).choices}
    with Client(shared_server.address) as client:
        assert client.status().num_requests == 4
        stream.close()

        def all_free():
            status = client.status()
            used = [w.kv_pages_used for pool in status.pools for w in pool.workers]
            return status.num_requests == 0 and not any(used)

        wait_for(all_free, 10, "pages freed after the client left a stream of two prompts")


def test_too_many_prompts_is_400_naming_prompt(api, model):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model, prompt=[[0, 5]] * (MAX_PROMPTS + 1), max_tokens=1)
    assert e.value.body["param"] == "prompt" and f"at most {MAX_PROMPTS}" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model, prompt=["a", [0, 10**6]], max_tokens=1)
    assert e.value.body["param"] == "prompt[1]"  # a fault in one prompt names it


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(api, model, chat):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if chat:
        messages = [{"role": "user", "content": "Count."}]
        stream = api.chat.completions.create(
            model=model, messages=messages, stream=True, stream_options=options, logprobs=True,
            **greedy(6),
        )  # fmt: skip
    else:
        stream = api.completions.create(
            model=model, prompt=[0, *range(20, 40)], stream=True, stream_options=options,
            logprobs=0, **greedy(6),
        )  # fmt: skip
    chunks = list(stream)
    *body, last = chunks
    assert not last.choices and last.usage.completion_tokens == 6
    assert body and all(c.choices and c.usage is not None for c in body)
    # each chunk's usage counts the tokens sent up to it (log-probabilities: one entry per token)
    sent = 0
    for c in body:
        lp = c.choices[0].logprobs
        sent += len((lp.content if chat else lp.tokens) or []) if lp else 0
        assert c.usage.completion_tokens == sent
    assert sent == 6
    assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}
    assert all(
        c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks
    )


def test_openai_fields_vllm_ignores_are_ignored_named_and_warned_once(api, model, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.frontend.openai_fields")
    unknown = f"made_up_{uuid.uuid4().hex[:8]}"
    fields = {
        "store": True, "metadata": {"run": "x"}, "service_tier": "auto", "reasoning_effort": "low",
        "modalities": ["text"], "prediction": {"type": "content", "content": "a"}, "verbosity": "low",
        "prompt_cache_key": "k", "safety_identifier": "s",
    }  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    names = [*fields, unknown]

    def ask():
        return api.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=2, **fields, extra_body={unknown: 1}
        )

    raw = ask()
    assert sorted(raw.headers[IGNORED_HEADER].split(", ")) == sorted(names)  # the client's order
    assert raw.parse().choices[0].finish_reason in ("length", "stop")
    warned = [r.getMessage() for r in caplog.records if unknown in r.getMessage()]
    assert len(warned) == 1 and caplog.records[-1].levelno == logging.WARNING
    ask()
    assert len([r for r in caplog.records if unknown in r.getMessage()]) == 1  # once per name
    # streamed too, with stream_options' own; and none where nothing was ignored
    raw = api.completions.with_raw_response.create(
        model=model, prompt=[0, 5], stream=True, extra_body={"ignore_eos": True, "store": False},
        stream_options={"include_usage": True, "include_obfuscation": False}, max_tokens=2,
    )  # fmt: skip
    assert raw.headers[IGNORED_HEADER] == "store, stream_options.include_obfuscation"
    assert list(raw.parse())[-1].usage.completion_tokens == 2
    raw = api.completions.with_raw_response.create(model=model, prompt=[0, 5], **greedy(1))
    assert IGNORED_HEADER not in raw.headers
    # a field it knows, with a value of the wrong type, is still refused by name
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=model, messages=messages, store="yes", max_tokens=1)
    assert e.value.body["param"] == "store"
