# WS /v1/realtime: the OpenAI Realtime API (realtime/connection.py runs the session). The API key is
# checked here, as `Authorization: Bearer <key>` or, from browsers (which cannot set headers on a
# WebSocket), as the `openai-insecure-api-key.<key>` subprotocol; the HTTP middleware sees no WebSockets.
from __future__ import annotations

import secrets

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from openai_frontend.errors import error_body
from openai_frontend.realtime.connection import RealtimeConnection, RealtimeLimits
from openai_frontend.realtime.events import EventError

router = APIRouter()

KEY_PROTOCOL = "openai-insecure-api-key."
SUBPROTOCOL = "realtime"  # what browsers offer beside the key; the server must pick one they offered


def _key_given(websocket: WebSocket) -> str:
    header = websocket.headers.get("authorization", "")
    if header.startswith("Bearer "):
        return header[len("Bearer "):]
    for protocol in websocket.scope.get("subprotocols", []):
        if protocol.startswith(KEY_PROTOCOL):
            return protocol[len(KEY_PROTOCOL):]
    return ""


@router.websocket("/v1/realtime")
async def realtime(websocket: WebSocket) -> None:
    app = websocket.app
    settings = app.state.settings
    limits: RealtimeLimits = getattr(app.state, "realtime_limits", None) or RealtimeLimits()
    if settings.api_key and not secrets.compare_digest(_key_given(websocket).encode(), settings.api_key.encode()):
        body = error_body(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or the "
                               f"'{KEY_PROTOCOL}<key>' subprotocol", code="invalid_api_key")  # fmt: skip
        await websocket.send_denial_response(JSONResponse(body, status_code=401))
        return
    offered = websocket.scope.get("subprotocols", [])
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)

    async def send_text(text: str) -> None:
        await websocket.send_text(text)

    async def close(code: int, reason: str) -> None:
        await websocket.close(code, reason)

    session = RealtimeConnection(app.state.client, settings, limits, getattr(app.state, "metrics", None),
                                 send_text, close)  # fmt: skip
    model = websocket.query_params.get("model")
    open_sessions = getattr(app.state, "realtime_sessions", 0)
    refusal = None
    if model is not None and model not in settings.served_model_names:
        refusal = EventError(settings.unknown_model(model), code="model_not_found", param="model", close=True)
    elif open_sessions >= limits.max_sessions:
        refusal = EventError(f"this server holds its limit of {limits.max_sessions} realtime sessions; retry later",
                             code="server_overloaded", kind="server_error", close=True)  # fmt: skip
    if refusal is not None:
        await session.fail(refusal)
        return

    async def receive() -> str | bytes | None:
        try:
            message = await websocket.receive()
        except (WebSocketDisconnect, RuntimeError):
            return None
        if message["type"] == "websocket.disconnect":
            return None
        text = message.get("text")
        return text if text is not None else message.get("bytes") or b""

    app.state.realtime_sessions = open_sessions + 1
    try:
        await session.run(receive)
    finally:
        app.state.realtime_sessions -= 1
        await session.shutdown(1000, "session ended")
