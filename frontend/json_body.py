"""A request body's JSON, decoded and checked to hold only what the OpenAI API can take, before any field is
read: at most `MAX_JSON_DEPTH` levels of nesting, text that is Unicode (no lone surrogate), integer literals
the interpreter reads. Every refusal is an InvalidRequestError naming where the body is wrong; the offending
text is never quoted. Pure Python: no I/O, no event loop (the HTTP server runs it in a thread for a large
body)."""

from __future__ import annotations

import json
import sys
from typing import Any

from pdserve.frontend.validation import has_lone_surrogate
from pdserve.model.errors import InvalidRequestError

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have. OpenAI's requests nest a few levels (a chat
message's content parts are 4 deep); the JSON decoder recurses once per level, and deeper bodies are refused."""


def decode_body(raw: bytes) -> Any:
    """A request body decoded from JSON and checked to hold only what the API can take: at most
    `MAX_JSON_DEPTH` levels of nesting, and text that is Unicode (no lone surrogate, which JSON can spell as
    `"\\ud800"` but no encoder, tokenizer or response can carry). Raises InvalidRequestError naming where it
    is wrong (`messages[0].content`, or `body`); the offending text is never quoted."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidRequestError(
            "body", f"nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError("body", f"not valid JSON ({e})") from None
    except ValueError:  # an integer literal past the interpreter's digit limit
        raise InvalidRequestError(
            "body", f"holds an integer of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    check_json(body)
    return body


def _where(path: tuple) -> str:
    """`('messages', 0, 'content')` as `messages[0].content`; the empty path is the body."""
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step:.64}" if out else f"{step:.64}")
    return out or "body"


def check_json(body: Any) -> None:
    """Raises InvalidRequestError where decoded JSON nests deeper than MAX_JSON_DEPTH or holds a string (a
    key or a value) with a lone surrogate. Walks without recursion; paths are built per container only."""
    stack: list[tuple[Any, tuple]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise InvalidRequestError(
                _where(path[:1]),
                f"nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects",
            )
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        for key, item in items:
            if isinstance(key, str) and has_lone_surrogate(key):
                raise InvalidRequestError(
                    _where(path), "a key holds a lone surrogate (\\ud800-\\udfff): not Unicode text"
                )
            if isinstance(item, str):
                if has_lone_surrogate(item):
                    raise InvalidRequestError(
                        _where((*path, key)),
                        "holds a lone surrogate (\\ud800-\\udfff): not Unicode text",
                    )
            elif isinstance(item, dict | list):
                stack.append((item, (*path, key)))
