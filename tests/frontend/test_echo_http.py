"""Echo and prompt log-probabilities through /v1/completions with the official `openai` client, on the shared tiny
fp32 server (one prefill and one decode worker: the prompt's log-probabilities come with the KV handoff). A
continuation scored as lm-eval's local-completions scores it (echo, logprobs, max_tokens 1, the sum of
token_logprobs over the continuation's tokens) equals the engine's own scoring of it; `max_tokens: 0` echoes
the prompt alone; vLLM's `prompt_logprobs` (and gRPC's) and a streamed echo carry the same figures."""

from __future__ import annotations

import openai
import pytest
from serving import engine_score

from pdserve.cli.client import Client, generate_request
from pdserve.engine.offline import OfflineGenerator
from pdserve.engine.sampling_params import MAX_PROMPT_LOGPROBS, SamplingParams


def test_a_continuation_scored_as_lm_eval_scores_it_equals_the_engine_s_score(
    api, model, reference_model, tokenizer
):
    context = tokenizer.encode("Question: which colour is the sky? Answer:")
    for continuation in (tokenizer.encode(" blue", add_bos=False), [300, 301, 302]):
        ids = [*context, *continuation]
        # lm-eval's local-completions payload for a log-likelihood request (a batch of one)
        reply = api.completions.create(
            model=model, prompt=[ids], echo=True, max_tokens=1, logprobs=1, temperature=0, seed=1
        )
        (choice,) = reply.choices
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None
        score = sum(lp.token_logprobs[len(context) : -1])
        assert score == pytest.approx(
            engine_score(reference_model, context, continuation), abs=1e-4
        )
        # lm-eval's is_greedy reads each token's entry among its alternatives (the best one's, with 1)
        for i in range(1, len(ids)):
            top = lp.top_logprobs[i]
            assert lp.token_logprobs[i] in top.values() and 1 <= len(top) <= 2
        assert choice.text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
        assert reply.usage.completion_tokens == 1


def test_max_tokens_0_echoes_the_prompt_alone_whole_and_streamed(api, model, tokenizer):
    prompt = "The quick brown fox"
    n = len(tokenizer.encode(prompt))
    reply = api.completions.create(model=model, prompt=prompt, echo=True, max_tokens=0, logprobs=2)
    (choice,) = reply.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == n and len(choice.logprobs.token_logprobs) == n
    assert choice.logprobs.text_offset[0] == 0
    assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs[1:])
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (n, 0)
    chunks = list(
        api.completions.create(
            model=model, prompt=prompt, echo=True, max_tokens=0, logprobs=2, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == prompt
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert len(streamed) == 1 and streamed[0].token_logprobs[0] is None
    assert streamed[0].tokens == choice.logprobs.tokens
    assert streamed[0].token_logprobs[1:] == pytest.approx(
        choice.logprobs.token_logprobs[1:], abs=1e-5
    )


def test_streamed_echo_starts_with_the_prompt_then_the_generated_text(api, model):
    prompt = "Once upon a time"
    whole = api.completions.create(model=model, prompt=prompt, echo=True, max_tokens=4,
                                   temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(
        api.completions.create(
            model=model,
            prompt=prompt,
            echo=True,
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    )
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.choices[0].text.startswith(prompt) and len(whole.choices[0].text) > len(prompt)
    # two choices, each starting with the prompt
    chunks = api.completions.create(model=model, prompt=prompt, echo=True, max_tokens=2, n=2,
                                    seed=3, temperature=1.0, stream=True)  # fmt: skip
    texts = ["", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert all(t.startswith(prompt) for t in texts)


@pytest.mark.parametrize(
    "max_tokens", [1, 8]
)  # 8: outputs the router joins keep the prompt's entries
def test_vllm_prompt_logprobs_name_each_token_its_rank_and_alternatives(
    api, model, reference_model, max_tokens
):
    ids = [0, *range(200, 215)]
    reply = api.completions.create(
        model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
        extra_body={"prompt_logprobs": 2, "ignore_eos": True},
    )  # fmt: skip
    prompt_logprobs = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    want = OfflineGenerator(reference_model, 4).generate(ids, params).prompt_logprobs
    for token, entry, lp in zip(ids[1:], prompt_logprobs[1:], want, strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
        assert entry[str(token)]["rank"] == lp.rank
        assert set(entry) == {str(t) for t in (*lp.top_ids, token)}
        for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
            assert entry[str(t)]["rank"] == rank
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
    # the choice's own text and logprobs are those of a request without prompt_logprobs
    plain = api.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.choices[0].text == plain.choices[0].text


def test_echo_and_prompt_logprobs_are_refused_by_name_where_they_cannot_be(api, model):
    n = MAX_PROMPT_LOGPROBS // 21 + 1
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        api.completions.create(
            model=model, prompt=[5] * n, max_tokens=1, extra_body={"prompt_logprobs": 20}
        )
    with pytest.raises(openai.BadRequestError, match="echo"):
        api.completions.create(model=model, prompt="hi", echo="yes", max_tokens=1)  # type: ignore
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model=model, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            extra_body={"prompt_logprobs": 1},
        )  # fmt: skip


def test_grpc_prompt_logprobs_come_on_the_first_chunk(shared_server, reference_model):
    ids = [0, *range(220, 232)]
    request = generate_request(ids, max_tokens=1, temperature=0, ignore_eos=True)
    request.sampling_params.prompt_logprobs = 1
    with Client(shared_server.address) as client:
        chunks = list(client.generate(request, timeout_s=60))
    got = chunks[0].prompt_logprobs
    want = OfflineGenerator(reference_model, 4).generate(
        ids, SamplingParams(max_tokens=1, prompt_logprobs=1)
    )
    assert len(got) == len(ids) - 1 and not any(c.prompt_logprobs for c in chunks[1:])
    for g, w in zip(got, want.prompt_logprobs, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4) and g.rank == w.rank
        assert list(g.top_token_ids) == list(w.top_ids)


def test_a_one_token_prompt_echoes_with_a_null_first_entry(api, model):
    reply = api.completions.create(
        model=model, prompt=[[7]], echo=True, max_tokens=0, logprobs=1,
        extra_body={"prompt_logprobs": 1, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    (choice,) = reply.choices
    assert choice.logprobs.tokens == ["token_id:7"] and choice.logprobs.token_logprobs == [None]
    assert choice.logprobs.top_logprobs == [None] and choice.model_extra["prompt_logprobs"] == [
        None
    ]


def test_a_list_of_prompts_echoes_each_choice_s_own_prompt(api, model, reference_model):
    """lm-eval's local-completions with --batch_size above 1: one request, several token-id prompts."""
    contexts = [[0, *range(240, 250)], [0, *range(260, 266)]]
    continuations = [[300, 301], [302]]
    prompts = [[*c, *x] for c, x in zip(contexts, continuations, strict=True)]
    reply = api.completions.create(
        model=model, prompt=prompts, echo=True, max_tokens=1, logprobs=1, temperature=0
    )
    choices = sorted(reply.choices, key=lambda c: c.index)
    assert len(choices) == 2
    for choice, context, continuation, ids in zip(
        choices, contexts, continuations, prompts, strict=True
    ):
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
        score = sum(lp.token_logprobs[len(context) : -1])
        assert score == pytest.approx(
            engine_score(reference_model, context, continuation), abs=1e-4
        )
