"""vLLM's tokenizer endpoints on the OpenAI HTTP server: POST /tokenize (text, or chat messages rendered by the
chat template, to the token ids a completions or chat request would run), POST /detokenize (ids to text) and
GET /tokenizer_info (the special tokens, the chat template, the context length).

Harnesses that score log-likelihoods count a prompt's tokens themselves: lm-eval's local-completions looks for
these three endpoints first (its `tokenizer_backend` auto or remote); without them it needs the checkpoint's
tokenizer on the client's machine, from the hub or a copy of the served directory. Requests are checked as
generation requests are (prompt bytes, Unicode, ids in the vocabulary); errors name the field."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve.cluster.config import RouterConfig
from pdserve.cluster.errors import NotFoundError
from pdserve.engine.checks import check_token_ids
from pdserve.frontend import openai_api as api
from pdserve.frontend.request_builder import build_request
from pdserve.frontend.validation import ModelInfo, check_prompt_bytes, has_lone_surrogate
from pdserve.model.errors import InvalidRequestError
from pdserve.model.tokenizer import Tokenizer


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(name, f"expected true or false, got {value!r:.80}")
    return value


def _check_body(body: Any, model: ModelInfo) -> Tokenizer:
    """The model's tokenizer, once `body` is an object naming this model or none."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "expected a JSON object")
    name = body.get("model")
    if name is not None and name != model.name:
        raise NotFoundError(
            f"model {str(name)!r:.120} is not served here (this server serves {model.name!r})"
        )
    if model.tokenizer is None:
        raise InvalidRequestError(
            "model", f"{model.name} has no tokenizer.json: nothing to tokenize with"
        )
    return model.tokenizer


CHAT_FIELDS = ("messages", "tools", "tool_choice", "functions", "function_call", "add_generation_prompt",
               "continue_final_message", "chat_template_kwargs")  # fmt: skip
"""What a /tokenize body may say of a chat, as chat completions take it."""


def tokenize(body: Any, model: ModelInfo, router: RouterConfig) -> dict:
    """vLLM's TokenizeResponse for a body with `prompt` (text; `add_special_tokens` default true: the BOS that
    completions add) or `messages` (the prompt ids a chat completion of the same messages, tools and template
    arguments runs; `add_special_tokens` default false: the template writes its own BOS, and true adds another,
    as vLLM does). `return_token_strs` adds each token's vocabulary entry."""
    tokenizer = _check_body(body, model)
    chat = body.get("messages") is not None
    add_special_tokens = _flag(body, "add_special_tokens", not chat)
    token_strs = _flag(body, "return_token_strs", False)
    if chat:
        request = api.parse({k: body[k] for k in CHAT_FIELDS if k in body}, api.CHAT)
        ids = build_request(request.inputs[0], model, router).prompt_ids
        if add_special_tokens and tokenizer.add_bos and tokenizer.bos_id is not None:
            ids = [tokenizer.bos_id, *ids]
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise InvalidRequestError("prompt", "expected a string (or messages: a chat)")
        check_prompt_bytes(text, router, "prompt", model)
        if has_lone_surrogate(text):
            raise InvalidRequestError(
                "prompt", "holds a lone surrogate (\\ud800-\\udfff): not Unicode text"
            )
        ids = tokenizer.encode(text, add_bos=add_special_tokens)
    return {
        "count": len(ids),
        "max_model_len": model.max_model_len,
        "tokens": ids,
        "token_strs": [tokenizer.token_str(i) for i in ids] if token_strs else None,
    }


def detokenize(body: Any, model: ModelInfo) -> dict:
    """vLLM's DetokenizeResponse (`prompt`: the text of `tokens`, special tokens kept) for a body with `tokens`,
    at most a context's worth of ids of the vocabulary."""
    tokenizer = _check_body(body, model)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise InvalidRequestError("tokens", "expected a list of token ids (integers)")
    if len(ids) > model.max_model_len:
        raise InvalidRequestError(
            "tokens", f"{len(ids)} ids; at most {model.max_model_len}, a context's worth"
        )
    check_token_ids(ids, model.vocab_size, "tokens")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


def tokenizer_info(model: ModelInfo) -> dict:
    """What a client needs to tokenize as the server does: the special tokens' texts, the chat template, whether a
    text prompt gets a BOS, the context length."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InvalidRequestError("model", f"{model.name} has no tokenizer.json")
    template = model.chat_template
    info = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model.max_model_len,
        "add_bos_token": tokenizer.add_bos,
        "chat_template": template.source if template is not None else None,
    }
    for name, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
        info[name] = tokenizer.token_str(token_id) if token_id is not None else None
    if template is not None:
        info.update(template.special_tokens)
    return info


class TokenizerEndpoints:
    """The three routes, over the HTTP front end's body reader (size limits, JSON checks) and error mapping."""

    def __init__(
        self,
        model: ModelInfo,
        router: RouterConfig,
        read_json: Callable[[Request], Awaitable[Any]],
        error: Callable[[BaseException], Response],
    ):
        self.model, self.router, self._read_json, self._error = model, router, read_json, error

    def routes(self) -> list[Route]:
        return [
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
        ]

    async def _answer(self, request: Request, work: Callable[[Any], dict]) -> Response:
        """`work`'s answer to the request's body, computed in a worker thread (tokenizing takes CPU)."""
        try:
            body = await self._read_json(request)
            return JSONResponse(await asyncio.to_thread(work, body))
        except Exception as e:  # the HTTP boundary: every error is answered in OpenAI's shape
            return self._error(e)

    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, lambda body: tokenize(body, self.model, self.router))

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, lambda body: detokenize(body, self.model))

    async def tokenizer_info(self, request: Request) -> Response:
        try:
            return JSONResponse(tokenizer_info(self.model))
        except Exception as e:  # the HTTP boundary, as above
            return self._error(e)
