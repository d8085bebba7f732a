# A fake Triton at the gRPC level: grpc.aio serving GRPCInferenceService's ModelStreamInfer and the
# readiness RPCs, scripted by the test. It records the requests it got and whether the client cancelled
# a stream, so the real TritonOmniClient (and the frontend subprocess over it) is tested without
# tritonserver.
from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor


def infer_response(
    *,
    text: str | None = None,
    token_ids: list[int] | None = None,
    audio: np.ndarray | None = None,
    finish_reason: str | None = None,
    usage: dict | None = None,
    final: bool = False,
    request_id: str = "",
) -> service_pb2.ModelInferResponse:
    """A ModelInferResponse of `omni_ensemble` as Triton would send it (raw output contents)."""
    r = service_pb2.ModelInferResponse(model_name="omni_ensemble", id=request_id)

    def add(name: str, datatype: str, shape: list[int], raw: bytes) -> None:
        out = r.outputs.add(name=name, datatype=datatype)
        out.shape.extend(shape)
        r.raw_output_contents.append(raw)

    def add_bytes(name: str, value: bytes) -> None:
        add(name, "BYTES", [1], len(value).to_bytes(4, "little") + value)

    if text is not None:
        add_bytes("text", text.encode("utf-8"))
    if token_ids is not None:
        add("token_ids", "INT64", [len(token_ids)], np.asarray(token_ids, dtype="<i8").tobytes())
    if audio is not None:
        add("audio", "FP32", [len(audio)], np.asarray(audio, dtype="<f4").tobytes())
    if finish_reason is not None:
        add_bytes("finish_reason", finish_reason.encode())
    if usage is not None:
        add_bytes("usage", json.dumps(usage).encode())
    r.parameters["triton_final_response"].bool_param = final
    return r


@dataclass
class Reply:
    """One message the fake sends on the stream: a response, or an error (`error` text)."""

    response: service_pb2.ModelInferResponse | None = None
    error: str | None = None
    delay_s: float = 0.0


@dataclass
class ReceivedRequest:
    model_name: str
    request_id: str
    parameters: dict[str, Any]
    messages: Any


def _param_value(p) -> Any:
    return getattr(p, p.WhichOneof("parameter_choice"))


@dataclass
class FakeTriton:
    replies: list[Reply] = field(default_factory=list)
    hang_after_replies: bool = False  # keep the stream open after the replies until cancelled
    model_ready: bool = True

    def __post_init__(self) -> None:
        self.received: list[ReceivedRequest] = []
        self.cancelled = asyncio.Event()
        self.port = 0

    # ---- servicer ------------------------------------------------------------------------------------
    async def ModelStreamInfer(self, request_iterator, context):
        request = await anext(aiter(request_iterator))
        messages = json.loads(deserialize_bytes_tensor(request.raw_input_contents[0])[0])
        params = {k: _param_value(v) for k, v in request.parameters.items()}
        self.received.append(ReceivedRequest(request.model_name, request.id, params, messages))
        try:
            for reply in list(self.replies):
                if reply.delay_s:
                    await asyncio.sleep(reply.delay_s)
                if reply.error is not None:
                    yield service_pb2.ModelStreamInferResponse(error_message=reply.error)
                else:
                    reply.response.id = request.id
                    yield service_pb2.ModelStreamInferResponse(infer_response=reply.response)
            if self.hang_after_replies:
                await asyncio.Event().wait()
        except asyncio.CancelledError:  # grpc.aio cancels the handler when the client cancels the call
            self.cancelled.set()
            raise

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=self.model_ready and request.name == "omni_ensemble")

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def RepositoryIndex(self, request, context):  # what the stage watchdog lists and probes
        model = service_pb2.RepositoryIndexResponse.ModelIndex(name="omni_ensemble", version="1", state="READY")
        return service_pb2.RepositoryIndexResponse(models=[model])

    async def ModelConfig(self, request, context):
        messages = model_config_pb2.ModelInput(name="messages", data_type=model_config_pb2.TYPE_STRING, dims=[1])
        return service_pb2.ModelConfigResponse(config=model_config_pb2.ModelConfig(name=request.name, input=[messages]))

    # ---- lifecycle -----------------------------------------------------------------------------------
    # Served on the test's own event loop (`async with`): grpc.aio misbehaves with a server loop in
    # another thread of the same process (its stop() hangs once a second loop has run).
    async def __aenter__(self) -> FakeTriton:
        self._server = grpc.aio.server()
        servicer = type("Servicer", (service_pb2_grpc.GRPCInferenceServiceServicer,), {
            name: getattr(self, name)
            for name in ("ModelStreamInfer", "ModelReady", "ServerReady", "ServerLive", "RepositoryIndex", "ModelConfig")
        })()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return self

    async def __aexit__(self, *_) -> None:
        await self._server.stop(None)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"


def closed_port() -> int:
    """A loopback port with nothing listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
