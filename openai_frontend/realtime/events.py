# The GA Realtime event protocol's envelope: ids, client events parsed, server events built, and errors
# as `error` events that carry the client event's id. The event bodies are built where they happen
# (session.py, response.py, connection.py); the names here are OpenAI's GA names.
from __future__ import annotations

import json
import secrets
from typing import Any

from openai_frontend.schemas import check_unicode

CLIENT_EVENTS = (
    "session.update",
    "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
    "conversation.item.create", "conversation.item.retrieve", "conversation.item.delete",
    "conversation.item.truncate",
    "response.create", "response.cancel",
)  # fmt: skip
# One client event, bounded by the WebSocket transport (uvicorn's ws_max_size): a bigger frame is closed with
# 1009 before it is buffered whole. An append of ~5 min of 24 kHz pcm16 in base64 fits; the input buffer's own
# limit (--realtime-max-buffered-audio) is lower.
MAX_EVENT_BYTES = 16 << 20


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


class EventError(Exception):
    """A client event the session refuses; the session lives on (unless `close` is set)."""

    def __init__(self, message: str, *, code: str = "invalid_value", param: str | None = None,
                 kind: str = "invalid_request_error", close: bool = False):  # fmt: skip
        super().__init__(message)
        self.message, self.code, self.param, self.kind, self.close = message, code, param, kind, close
        self.client_event_id: str | None = None


def error_event(err: EventError, client_event_id: str | None) -> dict[str, Any]:
    return {"type": "error", "event_id": new_id("event"),
            "error": {"type": err.kind, "code": err.code, "message": err.message, "param": err.param,
                      "event_id": client_event_id}}  # fmt: skip


def parse(raw: str | bytes) -> dict[str, Any]:
    """One client event: a JSON object with a known `type`; raises EventError otherwise."""
    try:
        event = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EventError(f"event is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(event, dict):
        raise EventError("an event must be a JSON object", code="invalid_event")
    # JSON may escape a lone surrogate, which no event that echoes it (session.updated, an item, an error
    # naming the event_id) can be encoded with for the WebSocket: the session would end without a word
    try:
        check_unicode(event)
    except ValueError as exc:
        raise EventError(str(exc), code="invalid_value") from None
    if isinstance(event.get("event_id"), str):  # known from here on: errors name the event they answer
        try:
            return _checked(event)
        except EventError as err:
            err.client_event_id = event["event_id"]
            raise
    return _checked(event)


def _checked(event: dict[str, Any]) -> dict[str, Any]:
    kind = event.get("type")
    if not isinstance(kind, str):
        raise EventError("an event needs a string 'type'", code="invalid_event", param="type")
    if kind not in CLIENT_EVENTS:
        raise EventError(f"unknown event type {kind!r}", code="unknown_event_type", param="type")
    if "event_id" in event and not isinstance(event["event_id"], str):
        raise EventError("event_id must be a string", param="event_id")
    return event


# a client writes JSON: its type errors name JSON's types, not Python's
JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number",
              bool: "a boolean"}  # fmt: skip


def field(event: dict[str, Any], name: str, kind: type | tuple[type, ...], *, required: bool = True,
          where: str = "") -> Any:  # fmt: skip
    """event[name] checked against `kind` (bool is not an int here); None when absent and optional."""
    param = f"{where}{name}"
    if name not in event or event[name] is None:
        if required:
            raise EventError(f"missing required parameter '{param}'", code="missing_required_parameter", param=param)
        return None
    value = event[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(JSON_TYPES.get(k, k.__name__) for k in kinds)
        raise EventError(f"'{param}' must be {names}", code="invalid_type", param=param)
    return value


def dumps(event: dict[str, Any]) -> str:
    return json.dumps(event, ensure_ascii=False, separators=(",", ":"))
