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
        cls, req, prompt_ids: list[int], tokenizer, token_text: Callable[[int], str]
    ) -> Echo | None:
        """For an `OpenAIRequest` of the completions API that echoes or asks for prompt_logprobs, else None;
        a prompt given as token ids is echoed decoded (special tokens kept), "" without a tokenizer."""
        if req.kind != "completions" or not req.echo and req.prompt_logprobs is None:
            return None
        text = ""
        if req.echo:
            text = req.input.prompt_text
            if text is None:
                text = "" if tokenizer is None else tokenizer.decode(prompt_ids, False)
        logprobs = req.input.sampling.logprobs if req.echo else None
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
