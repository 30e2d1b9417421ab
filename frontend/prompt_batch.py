"""A request that lists several prompts (OpenAI's completions API takes `prompt: ["a", "b"]`) served as one
request per prompt: each is checked and submitted on its own, and their choices are merged into one `Choices`
stream numbered prompt-major (prompt i's choice j is choice i * n + j), as OpenAI and vLLM number them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdserve.frontend.engine_client import Choices, Chunk, ChunkStream, EngineClient
from pdserve.frontend.request_builder import CheckedRequest


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
