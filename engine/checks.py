"""The request checks, one function each, with one wording each: the gRPC front end (`pdserve.cluster`), the
prefill and decode schedulers and the offline path (`pdserve offline`) all call these, so a bad request reads the
same wherever it is caught. Pure Python (no torch).

`field` names the request field as the caller's API spells it (`prompt_token_ids`, `sampling_params.max_tokens`,
...); the text after it never changes. Range checks of the sampling parameters live in
`SamplingParams.__post_init__`."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.pages import pages_needed
from pdserve.model.errors import CapacityError, InvalidRequestError


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Raises InvalidRequestError for an empty list or an id outside the vocabulary."""
    if not token_ids:
        raise InvalidRequestError(field, "is empty")
    for position, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                field,
                f"id {token} at position {position} is outside the vocabulary [0, {vocab_size})",
            )


def check_prompt_len(num_prompt_tokens: int, max_model_len: int, field: str) -> None:
    """Raises InvalidRequestError when the prompt leaves no room for a generated token."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            field,
            f"{num_prompt_tokens} tokens leave no room to generate in the model's context of "
            f"{max_model_len} tokens",
        )


def check_context(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, field: str = "max_tokens"
) -> None:
    """Raises InvalidRequestError when the prompt and max_tokens together exceed the model's context."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            field,
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens",
        )


def check_pages(num_tokens: int, page_size: int, num_pages: int, holder: str) -> None:
    """Raises CapacityError when `num_tokens` need more KV pages than `holder` (e.g. "this decode worker")
    has in all: such a request can never run there."""
    need = pages_needed(num_tokens, page_size)
    if need > num_pages:
        raise CapacityError(f"{num_tokens} tokens need {need} KV pages; {holder} has {num_pages}")
