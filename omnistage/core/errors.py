# Typed errors of the core. They are mapped once to Triton errors (omnistage/triton) and once to
# OpenAI's error envelope (openai_frontend), including mid-stream.
from __future__ import annotations

import re


class OmniError(Exception):
    """Base class; `code` is the HTTP status a client should see. `param` (the request field at fault)
    and `error_code` (a short machine-readable reason) fill OpenAI's error object."""

    code = 500
    error_code = "internal_error"

    def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.error_code = code


class BadRequestError(OmniError):
    """The request is invalid; nothing was started for it."""

    code = 400
    error_code = "invalid_request"


class EngineError(OmniError):
    """The engine failed while serving an accepted request."""

    code = 500
    error_code = "engine_error"


class OverloadedError(OmniError):
    """The stage cannot accept more work right now (queue full)."""

    code = 503
    error_code = "overloaded"
    retry_after_s = 1  # the frontend's Retry-After header


class StageUnavailableError(OmniError):
    """A stage cannot serve at all right now (its process died and is being reloaded)."""

    code = 503
    error_code = "stage_unavailable"
    retry_after_s = 5  # a reload takes seconds


# What the Python backend answers for a model whose stub process died (Triton 2.51 neither restarts the
# stub nor marks the model unready): "Stub process '<instance>' is not healthy."
STUB_DEAD_MARK = "is not healthy"
PROBE_ACTION = "probe"  # request parameter action=probe: every model answers at once, proving its stub runs


# On Triton's wire an error is one message, "[<status> param=<p> code=<c>] text" (param and code optional),
# written by the stages and omni_ensemble and read back by omni_ensemble and the frontend.
_WIRE = re.compile(r"^\[(\d{3})(?: param=(\S+))?(?: code=(\S+))?\]\s?(.*)$", re.DOTALL)


def to_wire(error: Exception) -> str:
    if not isinstance(error, OmniError):
        return f"[500] {error}"
    # a class's own code goes without saying (the reader restores it from the status)
    code = vars(error).get("error_code")
    tags = "".join(f" {k}={v}" for k, v in (("param", error.param), ("code", code)) if v)
    return f"[{error.code}{tags}] {error}"


def from_wire(message: str) -> OmniError | None:
    """The typed error of a wire message; None when it has no status prefix."""
    m = _WIRE.match(message)
    if m is None:
        return None
    status, param, code, text = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    if status == 503:
        kind = StageUnavailableError if STUB_DEAD_MARK in text else OverloadedError
    else:
        kind = {400: BadRequestError}.get(status, EngineError)
    error = kind(text, param=param, code=code)
    error.code = status  # keep what the model said (e.g. 413, 504)
    return error
