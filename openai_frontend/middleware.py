# Pure ASGI middleware (not BaseHTTPMiddleware, which would buffer streamed responses and hide
# disconnects): request accounting for /metrics, the optional API key, the request body limit and its
# read deadline; and the protocols' deadlines: for a request head, and for a client that stops reading.
from __future__ import annotations

import asyncio
import secrets
import time

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from openai_frontend.errors import error_body, error_response
from openai_frontend.metrics import FrontendMetrics

OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers need no key
# The browser demo's static files (app.py) are public too: a browser cannot attach the key to a page
# load, and the page holds no secret; it sends the key the user types on its own API calls.
DEMO_PATHS, DEMO_PREFIX = ("/", "/demo"), "/demo/"


class RequestAccounting:
    """Stamps the arrival time (`request.state.arrival`) and counts responses by route and status."""

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.perf_counter()
        status = [0]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"  # templates: bounded label values
            self.metrics.requests.labels(route, str(status[0] or 499)).inc()


class ApiKeyGuard:
    """With a key configured, every path but OPEN_PATHS needs `Authorization: Bearer <key>` (else 401)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in OPEN_PATHS + DEMO_PATHS and not path.startswith(DEMO_PREFIX):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):  # constant time: no key-guessing by timing
                body = error_body(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")  # fmt: skip
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


# A client gets this long for its request head on a new connection, and this long between two parts of
# its body; then the connection is closed (head) or the request answered 408 (body). Clients that send
# slowly on purpose (slowloris) otherwise hold a connection and its buffers for as long as they like.
HEAD_TIMEOUT_S = 10.0
BODY_READ_TIMEOUT_S = 30.0
# Once what the server sends fills the connection's buffers (the kernel's, then the transport's), the client
# gets this long to read some of it; then the connection is aborted, which ends its request or realtime
# session as a disconnect does (cancelling its backend request). A client that stops reading and keeps the
# connection open otherwise holds the connection, its session and everything its response has buffered for
# good: uvicorn waits for the buffer to drain before every send, and even a close waits for it.
WRITE_STALL_TIMEOUT_S = 30.0


class _WriteStallDeadline:
    """Aborts the connection once its transport has been paused for writing for WRITE_STALL_TIMEOUT_S."""

    _write_stall: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._write_stall is None:
            loop = self.loop  # type: ignore[attr-defined]
            self._write_stall = loop.call_later(WRITE_STALL_TIMEOUT_S, self._write_stalled)

    def resume_writing(self) -> None:
        self._cancel_write_stall()
        super().resume_writing()  # type: ignore[misc]

    def connection_lost(self, exc) -> None:
        self._cancel_write_stall()
        super().connection_lost(exc)  # type: ignore[misc]

    def _write_stalled(self) -> None:
        self._write_stall = None
        self.transport.abort()  # type: ignore[attr-defined]  # close() would wait for the buffer to drain

    def _cancel_write_stall(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None


class BoundedWebSocketProtocol(_WriteStallDeadline, WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol with the write-stall deadline (a realtime session nobody reads)."""


class BoundedH11Protocol(_WriteStallDeadline, H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the write-stall deadline (a streamed reply nobody reads) and a
    deadline for every request head: a new connection's first one, and on a kept-alive connection each later
    one from its first byte on. uvicorn's keep-alive timeout closes a connection idle after a response, but
    any byte stops that timer, so a client that trickles (or starts and abandons) its next head would hold
    the connection for good."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late, None)

    def data_received(self, data: bytes) -> None:
        # between two requests (the last response sent): these bytes start the next head
        if self._head_deadline is None and self.cycle is not None and self.cycle.response_complete:
            self._head_deadline = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late, self.cycle)
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._cancel_head_deadline()  # armed again by the first byte of the next head
        super().on_response_complete()

    def _head_late(self, cycle) -> None:
        self._head_deadline = None
        # a new cycle: the head arrived; another protocol: the connection was upgraded (a WebSocket)
        if self.cycle is cycle and self.transport.get_protocol() is self and not self.transport.is_closing():
            self.transport.close()

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def connection_lost(self, exc) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)


class BodyLimit:
    """413 for request bodies over `max_bytes`: at once from Content-Length, else while the body is read;
    408 when the client pauses longer than BODY_READ_TIMEOUT_S inside its body."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await error_response(self._too_large())(scope, receive, send)
        seen, body_done = 0, False

        async def limited_receive() -> Message:
            nonlocal seen, body_done
            if body_done:  # after the body: only http.disconnect comes, whenever the client leaves
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), BODY_READ_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"request body not received within {BODY_READ_TIMEOUT_S:.0f}s") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()  # FastAPI re-raises HTTPExceptions from body reading
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> HTTPException:
        return HTTPException(413, f"request body larger than {self.max_bytes} bytes")
