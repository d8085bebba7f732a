# OmniClient over Triton's gRPC streaming API (tritonclient.grpc.aio), one bidirectional stream per
# request: the request iterator yields the single request and ends (half-close); Triton keeps the
# stream open until the request's final response.
#
# Cancellation: leaving `stream()` before the final response, by aclose() or by a CancelledError
# thrown into it (client disconnect), runs its `finally`, which cancels the gRPC call; Triton then
# cancels the in-flight request (the Python backend sees `request.is_cancelled()`). grpc.aio itself
# cancels the call only when the task blocked in a read is cancelled, not when the generator is closed
# while suspended at a `yield` (the common case: the frontend is busy sending), hence the explicit
# cancel. After the final response the call is left to end by itself (Triton closes the stream).
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from tritonclient.grpc import aio as grpcclient
from tritonclient.utils import InferenceServerException

from omnistage.core.errors import EngineError, OmniError, StageUnavailableError
from omnistage.core.protocol import OMNI

from openai_frontend.omni_client import OmniChunk, OmniClient
from openai_frontend.stage_watchdog import StageWatchdog
from openai_frontend.triton_codec import (
    ResponseDecoder,
    TritonUnavailableError,
    error_from_message,
    stream_request,
)

__all__ = ["OmniChunk", "OmniClient", "TritonOmniClient"]

log = logging.getLogger("openai_frontend.triton")

_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class TritonOmniClient(OmniClient):
    def __init__(self, url: str, *, model_name: str = OMNI.name, ready_timeout_s: float = 2.0,
                 watchdog: StageWatchdog | None = None, headers: dict[str, str] | None = None):  # fmt: skip
        self.url = url
        self.headers = headers or {}  # Triton's key, when its inference API is restricted
        self.model_name = model_name
        self.ready_timeout_s = ready_timeout_s
        # with a watchdog, ready means every model of the server answers probes (stage_watchdog.py), and
        # a model whose stub died is reloaded; without, Triton's model readiness (blind to dead stubs)
        self.watchdog = watchdog
        self._open: dict[Any, str | None] = {}  # open Triton streams -> the model whose outage failed them
        if watchdog is not None:
            watchdog.on_outage.append(self._fail_open_streams)
        self._client: grpcclient.InferenceServerClient | None = None

    def _grpc(self) -> grpcclient.InferenceServerClient:
        # Created on first use: a grpc.aio channel binds to the event loop that is running when it is
        # made, and that is uvicorn's loop, which does not exist yet when the app is built.
        if self._client is None:
            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    def _fail_open_streams(self, model: str) -> None:
        # A reload strands the requests in flight on the old model instance, and a hung model answers none
        # (they never end), so they end here, as a 503 the client may retry.
        for responses in list(self._open):
            self._open[responses] = model
            responses.cancel()

    async def start(self) -> None:
        if self.watchdog is not None:
            self.watchdog.start()

    def health_report(self) -> dict | None:
        return None if self.watchdog is None else self.watchdog.report()

    async def ready(self) -> bool:
        if self.watchdog is not None:
            return await self.watchdog.ready()
        try:
            return bool(
                await self._grpc().is_model_ready(self.model_name, headers=self.headers, client_timeout=self.ready_timeout_s)
            )
        except InferenceServerException as exc:
            log.debug("readiness check failed: %s", exc)
            return False

    async def close(self) -> None:
        if self.watchdog is not None:
            await self.watchdog.stop()
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def stream(
        self, messages: list[dict[str, Any]], parameters: dict[str, Any], *, request_id: str = ""
    ) -> AsyncIterator[OmniChunk]:
        if self.watchdog is not None and not self.watchdog.serving:
            # a model is being reloaded: refused at once (503 + Retry-After) rather than failed half-way
            raise TritonUnavailableError(f"Triton at {self.url} is restarting a failed model; retry")
        request = stream_request(messages, parameters, model_name=self.model_name, request_id=request_id)

        async def requests():
            yield request

        try:
            responses = self._grpc().stream_infer(requests(), headers=self.headers)
        except InferenceServerException as exc:
            raise TritonUnavailableError(f"cannot reach Triton at {self.url}: {exc}") from exc
        decoder = ResponseDecoder()
        finished = False
        self._open[responses] = None
        try:
            async for result, error in responses:
                if error is not None:
                    raise error_from_message(error.message())
                chunk, finished = decoder.decode(result)
                if finished:
                    break
                yield chunk
            else:
                # The stream closed without a final flag: complete if the model said it had finished.
                if decoder.finish_reason is None:
                    raise EngineError(f"{self.model_name} closed the stream before its final response")
                finished = True
                chunk = OmniChunk(finish_reason=decoder.finish_reason, usage=decoder.usage)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if self._open.get(responses):
                raise StageUnavailableError(f"Triton at {self.url} lost model {self._open[responses]} (a failed stage "
                                            "being restarted, or one that stopped answering); retry") from exc
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise _rpc_error(exc, self.url) from exc
        finally:
            self._open.pop(responses, None)
            if not finished:
                responses.cancel()
        yield chunk  # the final chunk, once the call needs no cancelling


def _rpc_error(exc: grpc.aio.AioRpcError, url: str) -> OmniError:
    if exc.code() in _UNAVAILABLE:
        # a stream that breaks mid-response this way lost the server itself (workarounds.py, 13)
        return TritonUnavailableError(f"Triton at {url} unavailable ({exc.details()}): exited or restarting; retry")
    return error_from_message(exc.details() or str(exc.code()))
