"""The request checks: each raises its typed error naming the field, with its one wording."""

from __future__ import annotations

import pytest

from pdserve.model.checks import check_context, check_pages, check_prompt_len, check_token_ids
from pdserve.model.errors import CapacityError, InvalidRequestError


def test_token_ids_within_the_vocabulary_pass() -> None:
    check_token_ids([0, 5, 1023], 1024, "prompt_token_ids")


@pytest.mark.parametrize(
    "ids, message",
    [
        ([], "prompt_token_ids: is empty"),
        ([0, 1024], "prompt_token_ids: id 1024 at position 1 is outside the vocabulary [0, 1024)"),
        ([-1], "prompt_token_ids: id -1 at position 0 is outside the vocabulary [0, 1024)"),
    ],
)
def test_token_ids_refused(ids: list[int], message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_token_ids(ids, 1024, "prompt_token_ids")
    assert str(info.value) == message and info.value.field == "prompt_token_ids"


def test_prompt_len() -> None:
    check_prompt_len(4095, 4096, "prompt")
    with pytest.raises(InvalidRequestError) as info:
        check_prompt_len(4096, 4096, "prompt")
    assert str(info.value) == (
        "prompt: 4096 tokens leave no room to generate in the model's context of 4096 tokens"
    )


def test_context() -> None:
    check_context(4000, 96, 4096)
    with pytest.raises(InvalidRequestError) as info:
        check_context(4000, 97, 4096, field="sampling_params.max_tokens")
    assert info.value.field == "sampling_params.max_tokens"
    assert str(info.value).endswith(
        "prompt (4000 tokens) + max_tokens (97) exceeds the model's context of 4096 tokens"
    )


def test_pages() -> None:
    check_pages(64 * 8, 64, 8, "this decode worker")
    with pytest.raises(
        CapacityError, match="^513 tokens need 9 KV pages; this decode worker has 8$"
    ):
        check_pages(64 * 8 + 1, 64, 8, "this decode worker")
