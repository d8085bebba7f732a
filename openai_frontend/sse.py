# Server-sent events whose producer is cancelled when the HTTP client goes away, plus the same
# disconnect guard for non-streamed work.
#
# Why not starlette's StreamingResponse: with ASGI spec >= 2.4 it stops watching for disconnects and
# only notices one when a later send fails, so a stream waiting on the backend keeps running; and it
# never aclose()s the body iterator. Here a watcher task reads `receive` for http.disconnect during the
# whole response and cancels the work; the iterator is then closed, which cancels the Triton stream.
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from openai_frontend.errors import describe

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
# A stream whose first event has not come after HEADERS_AFTER_S (its request is queued behind others) gets
# its headers then, and a comment line every KEEPALIVE_S until events come: clients and proxies see a live
# response instead of a silent connection. Errors faster than that are still plain HTTP errors.
HEADERS_AFTER_S = 1.0
KEEPALIVE_S = 5.0
KEEPALIVE = b": keep-alive\n\n"


class ClientDisconnected(Exception):
    pass


def sse_event(data: str) -> str:
    return f"data: {data}\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            t.cancel()
        # let the cancelled work run its cleanup (closing backend streams) before we return
        await asyncio.wait((task, watcher))


class SSEResponse(Response):
    """`text/event-stream` of the strings `events` yields (each a complete event).

    The first event is awaited before anything is sent: if getting it raises, `on_error(exc)` renders a
    plain error response with its own status (e.g. the backend rejected the request with a 400), which
    is better for clients than a 200 stream that starts with an error.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str | bytes],
        on_error: Callable[[BaseException], Response],
        media_type: str | None = None,  # another streamed body (e.g. audio bytes) with the same guard
    ):
        # not Response.__init__: that would render an empty body and announce Content-Length: 0
        self.status_code = 200
        self.background = None
        self.media_type = media_type or self.media_type
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await cancel_on_disconnect(receive, self._send_events(scope, receive, send))
        except (ClientDisconnected, OSError):
            pass  # OSError: an ASGI >= 2.4 server reporting the disconnect on send
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]

    async def _send_events(self, scope: Scope, receive: Receive, send: Send) -> None:
        first_event = asyncio.ensure_future(anext(self.events))
        started = False
        try:
            # comments are only valid in an event stream (not, e.g., in a streamed audio body)
            while self.media_type == SSEResponse.media_type:
                done, _ = await asyncio.wait({first_event}, timeout=KEEPALIVE_S if started else HEADERS_AFTER_S)
                if done:
                    break
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                    started = True
                await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
            first = await first_event
        except StopAsyncIteration:
            first = None
        except Exception as exc:  # noqa: BLE001 - rendered as the HTTP error, or in-stream once headers are out
            if not started:
                await self.on_error(exc)(scope, receive, send)
                return
            await _body(send, sse_event(json.dumps(describe(exc)[1])) + DONE)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        finally:
            if not first_event.done():
                first_event.cancel()
                await asyncio.gather(first_event, return_exceptions=True)
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        if first is not None:
            await _body(send, first)
            async for event in self.events:
                await _body(send, event)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _body(send: Send, event: str | bytes) -> None:
    body = event if isinstance(event, bytes) else event.encode("utf-8")
    message: dict[str, Any] = {"type": "http.response.body", "body": body, "more_body": True}
    await send(message)
