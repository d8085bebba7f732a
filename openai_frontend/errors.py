# The one place errors become OpenAI's error object {"error": {message, type, param, code}}: typed
# backend errors (omnistage.core.errors), request validation (FastAPI's 422 becomes 400), HTTP errors
# of routing, unexpected exceptions; as a JSON response, or as the body of a mid-stream SSE event.
from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from omnistage.core.errors import OmniError

log = logging.getLogger("openai_frontend")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}
# pydantic error type -> OpenAI's error code
_VALIDATION_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter",
                     "json_invalid": "invalid_json", "value_error": "invalid_value"}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


class FrontendError(Exception):
    """An error the HTTP layer itself decides (e.g. unknown model), with its status and OpenAI code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def describe(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, error body) for any exception; unexpected ones are logged and hidden."""
    if isinstance(exc, FrontendError):
        return exc.status, error_body(exc.status, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, OmniError):
        status = int(getattr(exc, "code", 500))
        if status >= 500:  # refusals under overload (503) are expected in bulk: not worth a warning each
            log.log(logging.INFO if status == 503 else logging.WARNING, "backend error (%d): %s", status, exc)
        return status, error_body(status, str(exc) or type(exc).__name__, param=exc.param, code=exc.error_code)
    if isinstance(exc, RequestValidationError):
        message, param, code = _validation_message(exc.errors())
        return 400, error_body(400, message, param=param, code=code)
    if isinstance(exc, HTTPException):
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return exc.status_code, error_body(exc.status_code, str(exc.detail), code=code)
    log.error("unhandled error", exc_info=exc)
    return 500, error_body(500, "internal server error")


def error_response(exc: BaseException) -> JSONResponse:
    status, body = describe(exc)
    # 429/503 say when to come back: an overloaded stage (OverloadedError) soon, a restarting one later
    retry = getattr(exc, "retry_after_s", None) or (1 if status in (429, 503) else None)
    return JSONResponse(body, status_code=status, headers={"Retry-After": str(retry)} if retry else None)


def install_error_handlers(app: FastAPI) -> None:
    async def handle(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    for kind in (FrontendError, OmniError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(kind, handle)


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None, str]:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    kind = str(first.get("type", "value_error"))
    code = _VALIDATION_CODES.get(kind, "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value")
    if kind == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')}", None, code
    param = _param(first.get("loc", ()))
    text = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None and kind == "missing":
        text = "a JSON request body is required"
    elif param is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        text = "the request body must be a JSON object, sent with Content-Type: application/json"
    elif param is None and _FIELD.match(text):
        param = _FIELD.match(text).group(1)  # a check across fields names the field it is about first
    message = f"{param}: {text}" if param and not text.startswith(param) else text
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return message, param, code


_FIELD = re.compile(r"^([a-z][a-z_]*)\b")


def _param(loc: tuple[Any, ...]) -> str | None:
    # ("body", "messages", 0, "content") -> "messages[0].content"
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None
