"""A request that lists several prompts (OpenAI's completions API takes `prompt: ["a", "b"]`, and lists of token
id lists, as lm-eval sends a batch) served as one request per prompt: the list is read and bounded
(`completion_prompts`, at most MAX_PROMPTS), each prompt is checked and submitted on its own, and their choices
are merged into one `Choices` stream numbered prompt-major (prompt i's choice j is choice i * n + j), as OpenAI
and vLLM number them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdserve.frontend.engine_client import Choices, Chunk, ChunkStream, EngineClient
from pdserve.frontend.request_builder import CheckedRequest
from pdserve.model.errors import InvalidRequestError

MAX_PROMPTS = 128
"""Prompts one /v1/completions request may list; each becomes a request of its own."""
MAX_CHOICES = 256
"""Choices one request may ask for in all: prompts x n."""


def _int_list(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    )


def completion_prompts(body: dict) -> list[tuple[str | None, list[int] | None]]:
    """The prompts of a completions body, each as (text, None) or (None, token ids): one string or list of
    token ids, or a list of up to MAX_PROMPTS of either."""
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequestError("prompt", "missing: a string or a list of token ids")
    if isinstance(prompt, str) or _int_list(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and any(isinstance(p, str | list) for p in prompt):
        prompts = prompt
    elif prompt == []:
        raise InvalidRequestError("prompt", "is empty")
    else:
        raise InvalidRequestError(
            "prompt", "expected a string, a list of token ids, or a list of either"
        )
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequestError(
            "prompt", f"{len(prompts)} prompts; one request takes at most {MAX_PROMPTS}"
        )
    out = []
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str) and p:
            out.append((p, None))
        elif _int_list(p) and p:
            out.append((None, p))
        elif p in ("", []):
            raise InvalidRequestError(where, "is empty")
        else:
            raise InvalidRequestError(where, "expected a string or a list of token ids")
    return out


class _Renumbered(ChunkStream):
    """One choice's stream with its chunks' `index` set to the choice's place in the merged request."""

    def __init__(self, stream: ChunkStream, index: int):
        self._stream, self._index = stream, index

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    async def __anext__(self) -> Chunk:
        return dataclasses.replace(await anext(self._stream), index=self._index)

    def cancel(self) -> None:
        self._stream.cancel()


def submit_all(engine: EngineClient, requests: Sequence[CheckedRequest]) -> Choices:
    """Submits each checked request (one per prompt) and returns their choices as one stream, prompt-major.
    A submit that fails cancels those already submitted and raises."""
    submitted: list[Choices] = []
    try:
        for request in requests:
            submitted.append(engine.submit(request))
    except BaseException:
        for choices in submitted:
            choices.cancel()
        raise
    if len(submitted) == 1:
        return submitted[0]
    streams = [g for choices in submitted for g in choices.generations]
    return Choices([_Renumbered(g, i) for i, g in enumerate(streams)])
