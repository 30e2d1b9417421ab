"""The completions API's `echo` and vLLM's `prompt_logprobs`, shaped from a request's prompt and the prompt
log-probabilities its first chunk carries (`Chunk.prompt_logprobs`; the engine scores each prompt token after
the first given the tokens before it, `SamplingParams.prompt_logprobs`).

With echo a choice's text starts with the prompt's (the request's text, or its token ids decoded) and, with
`logprobs`, its log-probabilities start with the prompt tokens' in OpenAI's legacy shape: the first token has
none (null in `token_logprobs` and `top_logprobs`), as OpenAI and vLLM answer. lm-eval's local-completions
scores a continuation as the sum of `token_logprobs` over its tokens this way. Pure Python."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from pdserve.engine.sampling_params import TokenLogprobs
from pdserve.frontend.openai_api import completion_choice, token_id_text
from pdserve.model.errors import PdserveError


def _alternatives(
    token: int, lp: TokenLogprobs, k: int, token_text: Callable[[int], str]
) -> dict[str, float]:
    """The `k` most likely tokens' texts to their log-probabilities, the token's own included."""
    out = {token_text(t): v for t, v in zip(lp.top_ids[:k], lp.top_logprobs[:k], strict=True)}
    if token not in lp.top_ids[:k]:
        out[token_text(token)] = lp.logprob
    return out


def _checked(prompt_ids: Sequence[int], prompt_logprobs: list[TokenLogprobs] | None) -> list:
    if prompt_logprobs is None or len(prompt_logprobs) != max(len(prompt_ids) - 1, 0):
        got = "none" if prompt_logprobs is None else len(prompt_logprobs)
        raise PdserveError(
            f"the prompt's log-probabilities did not come back with its first output ({got} for "
            f"{len(prompt_ids)} prompt tokens)"
        )
    return prompt_logprobs


def prompt_completion_logprobs(
    prompt_ids: Sequence[int], prompt_logprobs: list[TokenLogprobs] | None, k: int,
    token_text: Callable[[int], str],
) -> dict:  # fmt: skip
    """The completions API's `logprobs` of the prompt's tokens (`api.completion_logprobs`' shape, `k`
    alternatives per token): the first token's entries null; text_offset from 0 over the tokens' texts."""
    lps = _checked(prompt_ids, prompt_logprobs)
    texts = [token_text(t) for t in prompt_ids]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None, *(lp.logprob for lp in lps)],
        "top_logprobs": [None] * bool(prompt_ids)
        + [_alternatives(t, lp, k, token_text) for t, lp in zip(prompt_ids[1:], lps, strict=True)],
        "text_offset": offsets,
    }


def joined(prompt: dict, generated: dict | None) -> dict:
    """The prompt's completion log-probabilities followed by the generated tokens' (None: none)."""
    if generated is None:
        return prompt
    return {key: [*prompt[key], *generated[key]] for key in prompt}


def vllm_prompt_logprobs(
    prompt_ids: Sequence[int], prompt_logprobs: list[TokenLogprobs] | None, k: int,
    token_text: Callable[[int], str],
) -> list[dict | None]:  # fmt: skip
    """vLLM's `prompt_logprobs` of a choice: per prompt token (None for the first) a map from token id (as a
    string) to its logprob, rank and decoded_token, for the token itself and the `k` most likely."""
    lps = _checked(prompt_ids, prompt_logprobs)
    out: list[dict | None] = [None] * bool(prompt_ids)
    for token, lp in zip(prompt_ids[1:], lps, strict=True):
        entry = {}
        for rank, (t, v) in enumerate(zip(lp.top_ids[:k], lp.top_logprobs[:k], strict=True), 1):
            entry[str(t)] = {"logprob": v, "rank": rank, "decoded_token": token_text(t)}
        if str(token) not in entry:
            entry = {
                str(token): {"logprob": lp.logprob, "rank": lp.rank,
                             "decoded_token": token_text(token)},
                **entry,
            }  # fmt: skip
        out.append(entry)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Echo:
    """What a completions request's choices start with (`OpenAIRequest.echo`, `prompt_logprobs`)."""

    prompt_ids: list[int]
    text: str
    """The prompt's text as echoed ("" without echo)."""
    logprobs: int | None
    """With echo and `logprobs`: the alternatives per prompt token in the choice's logprobs; else None."""
    prompt_logprobs: int | None
    """vLLM's prompt_logprobs: the alternatives per prompt token in the choice's `prompt_logprobs`."""
    prompt_only: bool
    """`max_tokens: 0`: the generated token is dropped."""
    token_text: Callable[[int], str]
    """How the request's log-probabilities name a token."""

    @classmethod
    def of(
        cls, req, given, prompt_ids: list[int], tokenizer, token_text: Callable[[int], str]
    ) -> Echo | None:
        """For one prompt (`given`, a `RequestInput`, its `prompt_ids`) of an `OpenAIRequest` of the
        completions API that echoes or asks for prompt_logprobs, else None; a prompt given as token ids is
        echoed decoded (special tokens kept), "" without a tokenizer."""
        if req.kind != "completions" or not req.echo and req.prompt_logprobs is None:
            return None
        text = ""
        if req.echo:
            text = given.prompt_text
            if text is None:
                text = "" if tokenizer is None else tokenizer.decode(prompt_ids, False)
        logprobs = given.sampling.logprobs if req.echo else None
        return cls(
            list(prompt_ids), text, logprobs, req.prompt_logprobs, req.prompt_only, token_text
        )

    def fields(self, prompt_logprobs: list[TokenLogprobs] | None) -> tuple[dict | None, dict]:
        """For a choice's first chunk (or whole choice): the prompt's completions logprobs (None: not asked)
        and the choice's extra fields (`prompt_logprobs` where asked)."""
        logprobs = None
        if self.logprobs is not None:
            logprobs = prompt_completion_logprobs(
                self.prompt_ids, prompt_logprobs, self.logprobs, self.token_text
            )
        extra = {}
        if self.prompt_logprobs is not None:
            extra["prompt_logprobs"] = vllm_prompt_logprobs(
                self.prompt_ids, prompt_logprobs, self.prompt_logprobs, self.token_text
            )
        return logprobs, extra

    def choice(self, choice: dict, prompt_logprobs: list[TokenLogprobs] | None) -> dict:
        """A completion choice (`api.completion_choice`; its logprobs' text_offset counted from the end of
        the echoed text) with the prompt in front: its text and log-probabilities where echoed, and its
        `prompt_logprobs` where asked."""
        prompt_lp, fields = self.fields(prompt_logprobs)
        choice = {**choice, "text": self.text + choice["text"], **fields}
        if prompt_lp is not None:
            choice["logprobs"] = joined(prompt_lp, choice["logprobs"])
        return choice


class Echoes:
    """What the choices of one request (prompt-major: choice i is prompt i // n's) start with, and the
    prompt log-probabilities that came with each choice's first chunk; nothing for a request that echoes
    nothing and asks for no prompt log-probabilities (every method then leaves what it is given)."""

    def __init__(self, req, checked, tokenizer, token_text: Callable[[int], str]):
        """req: an `OpenAIRequest`; checked: its prompts' `CheckedRequest`s; token_text: how log-probabilities
        name a token by its text (`token_id:N` where the request asks for ids)."""
        if req.tokens_as_ids:
            token_text = token_id_text
        self.n, self.prompt_only = req.n, req.prompt_only
        self.echoes = [
            Echo.of(req, g, c.prompt_ids, tokenizer, token_text)
            for g, c in zip(req.inputs, checked, strict=True)
        ]
        self.prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
        self.opened: set[int] = set()

    def _echo(self, index: int) -> Echo | None:
        return self.echoes[index // self.n]

    def offset(self, index: int) -> int:
        """Characters of choice `index`'s text before its generated text."""
        echo = self._echo(index)
        return 0 if echo is None else len(echo.text)

    def kept(self, chunk):
        """A `Chunk` as its choice answers it: its prompt log-probabilities taken note of, and with
        `max_tokens: 0` its generated tokens dropped."""
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs[chunk.index] = chunk.prompt_logprobs
        if not self.prompt_only:
            return chunk
        return dataclasses.replace(
            chunk, token_ids=[], text="", logprobs=None, num_generated_tokens=0
        )

    def choice(self, index: int, choice: dict) -> dict:
        """A whole completion choice (`Echo.choice`) of a choice whose chunks were all `kept`."""
        echo = self._echo(index)
        return choice if echo is None else echo.choice(choice, self.prompt_logprobs.get(index))

    def opening(self, chunk) -> dict | None:
        """For a stream: the choice to send before the first chunk of `chunk`'s choice (its prompt, its
        prompt log-probabilities), None after it or with nothing to send."""
        index = chunk.index
        echo = self._echo(index)
        if echo is None or index in self.opened:
            return None
        self.opened.add(index)
        return echo.choice(completion_choice("", None, index), chunk.prompt_logprobs)
