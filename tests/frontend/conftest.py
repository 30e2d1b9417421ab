"""Fixtures of the front-end tests on the session's shared server: the official `openai` client on its HTTP API,
the served model's name, and the tiny model's tokenizer."""

from __future__ import annotations

import openai
import pytest

from pdserve.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def api(shared_server):
    return openai.OpenAI(
        base_url=shared_server.http_url, api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def model(shared_server) -> str:
    return shared_server.server.model.name


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)
