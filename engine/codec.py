"""The codec of the router's and workers' messages (`engine.messages`): msgpack bytes, never pickle. A frozen
dataclass travels as a map of its fields and is rebuilt from its type hints (nested dataclasses, tuples,
lists, optionals); an error travels as its class name, message and field, and is raised again on the caller's
side as its pdserve class."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from pdserve.model import errors

T = TypeVar("T")

_ERRORS: dict[str, type[errors.PdserveError]] = {
    cls.__name__: cls
    for cls in (
        errors.PdserveError,
        errors.ConfigError,
        errors.CheckpointError,
        errors.InvalidRequestError,
        errors.CapacityError,
        errors.TransferError,
        errors.RequestAbortedError,
    )
}


class WorkerError(errors.PdserveError):
    """An unexpected exception inside a worker actor (its message is the worker's `repr` of it)."""


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [_to_plain(x) for x in obj]
    return obj


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _identity(value: Any) -> Any:
    return value


@functools.cache
def _decoder(hint: Any) -> Callable[[Any], Any]:
    """A function from msgpack's plain values to `hint`, built once per type: the router decodes every decode
    step's outputs, so nothing about the type is looked up per value. Plain values (and lists of them) pass
    through as they are."""
    if dataclasses.is_dataclass(hint):
        convert = {k: _decoder(h) for k, h in _hints(hint).items()}
        convert = {k: c for k, c in convert.items() if c is not _identity}
        if not convert:
            return lambda value: None if value is None else hint(**value)

        nested = tuple(convert.items())

        def dataclass_from(value):
            if value is None:
                return None
            for k, c in nested:  # msgpack's fresh dict: converted in place (None stays None)
                v = value.get(k)
                if v is not None:
                    value[k] = c(v)
            return hint(**value)

        return dataclass_from
    origin = typing.get_origin(hint)
    if origin is tuple:
        item = _decoder(typing.get_args(hint)[0])
        return lambda value: None if value is None else tuple(item(x) for x in value)
    if origin is list:
        item = _decoder(typing.get_args(hint)[0])
        if item is _identity:
            return _identity
        return lambda value: None if value is None else [item(x) for x in value]
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _decoder(inner[0]) if len(inner) == 1 else _identity
    return _identity


def _from_plain(hint: Any, value: Any) -> Any:
    return _decoder(hint)(value)


def encode(obj: Any) -> bytes:
    """A dataclass (or a list of them, or plain values) as msgpack bytes."""
    return msgpack.packb(_to_plain(obj), use_bin_type=True)


def decode(hint: type[T] | Any, data: bytes) -> T:
    """The inverse of `encode`, given the type (`RequestOutput`, `list[RequestOutput]`, ...)."""
    return _from_plain(hint, msgpack.unpackb(data, raw=False))


def reply(fn: Callable[[], Any]) -> bytes:
    """Runs `fn` on the worker's side; its result, or the pdserve error it raised, as a msgpack envelope.
    Unexpected exceptions propagate (the actor shell logs them and converts them with `reply_error`)."""
    try:
        return msgpack.packb({"ok": _to_plain(fn())}, use_bin_type=True)
    except errors.PdserveError as e:
        return reply_error(e)


def reply_error(e: BaseException) -> bytes:
    field = getattr(e, "field", None)
    message = e.args[0] if e.args and isinstance(e, errors.PdserveError) else repr(e)
    if field is not None:
        message = message.removeprefix(f"{field}: ")
    kind = type(e).__name__ if type(e).__name__ in _ERRORS else "WorkerError"
    return msgpack.packb({"err": [kind, str(message), field]}, use_bin_type=True)


def unwrap(hint: type[T] | Any, data: bytes) -> T:
    """The result inside a `reply` envelope, or the error it carries raised again as its pdserve class."""
    envelope = msgpack.unpackb(data, raw=False)
    if "err" in envelope:
        kind, message, field = envelope["err"]
        if kind == "InvalidRequestError":
            raise errors.InvalidRequestError(field or "request", message)
        raise _ERRORS.get(kind, WorkerError)(message)
    return _from_plain(hint, envelope["ok"])
