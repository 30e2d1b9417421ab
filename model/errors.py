"""pdserve's error hierarchy. Every error a user, a config file, a checkpoint or a peer can cause is one of these;
`pdserve.frontend.errors` maps them to gRPC status codes and the CLI prints them as one line."""

from __future__ import annotations


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose."""


class ConfigError(PdserveError, ValueError):
    """A configuration value (config.json, a serve config, a CLI flag) is missing, malformed or unsupported."""


class CheckpointError(PdserveError):
    """A checkpoint directory is incomplete or inconsistent: the message names the tensor, field or file."""


class InvalidRequestError(PdserveError, ValueError):
    """A request is malformed; `field` names the offending request field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class CapacityError(PdserveError):
    """The request cannot be held: not enough KV pages or queue room right now."""


class TransferError(PdserveError):
    """A KV transfer between a prefill and a decode worker failed or timed out."""


class RequestAbortedError(PdserveError):
    """The request was cancelled, missed its deadline, or lost its worker."""
