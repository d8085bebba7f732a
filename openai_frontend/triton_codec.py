# Pure translation between OmniClient values and the `omni_ensemble` wire format (tritonclient
# objects and protobufs): request tensors and parameters out, InferResults and errors in.
# No I/O here, so it is unit-tested without a server.
from __future__ import annotations

import codecs
import json
from typing import Any

import numpy as np
from tritonclient.grpc import InferInput

from omnistage.core.errors import STUB_DEAD_MARK, EngineError, OmniError, StageUnavailableError, from_wire
from omnistage.core.protocol import OMNI
from omnistage.triton.workarounds import NOT_READY

from openai_frontend.omni_client import OmniChunk

# Triton switches sent with every request, next to the model's own parameters.
# The empty final response carries the `triton_final_response` flag when the model sends the final
# flag without data; without it the client could only learn the end from the stream closing.
TRITON_SWITCHES = {"triton_enable_empty_final_response": True}

_CONVERT = {
    "int": int,
    "float": float,
    "bool": bool,
    "string": str,
    "json": lambda v: v if isinstance(v, str) else json.dumps(v),
}


class TritonUnavailableError(OmniError):
    """Triton could not be reached (connection refused, server shutting down)."""

    code = 503
    retry_after_s = 5


def encode_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    """OMNI request parameters as Triton parameter values (str / bool / int / float)."""
    out: dict[str, Any] = {}
    for name, value in parameters.items():
        kind = OMNI.parameters.get(name)
        if kind is None:
            raise ValueError(f"'{name}' is not a parameter of {OMNI.name}")
        if value is None:
            continue
        out[name] = _CONVERT[kind](value)
    return out


def encode_messages(messages: list[dict[str, Any]]) -> InferInput:
    spec = OMNI.input("messages")
    tensor = InferInput(spec.name, list(spec.dims), "BYTES")
    payload = json.dumps(messages, ensure_ascii=False).encode("utf-8")
    tensor.set_data_from_numpy(np.array([payload], dtype=np.object_))
    return tensor


def stream_request(messages, parameters, *, model_name: str, request_id: str = "") -> dict[str, Any]:
    """One element of the request iterator that `aio.InferenceServerClient.stream_infer` consumes."""
    return {
        "model_name": model_name,
        "inputs": [encode_messages(messages)],
        "request_id": request_id,
        "parameters": {**encode_parameters(parameters), **TRITON_SWITCHES},
    }


def error_from_message(message: str) -> OmniError:
    """A Triton error message as a typed error (core/errors.py's wire form: status, param, code)."""
    error = from_wire(message)
    if error is not None:
        return error
    # omni_ensemble's own stub died, or it is being reloaded (a stage's outage comes as a 503 from it)
    if STUB_DEAD_MARK in message or NOT_READY.search(message):
        return StageUnavailableError(f"stage unavailable (being restarted): {message}")
    return EngineError(message)


class ResponseDecoder:
    """Turns the InferResults of one stream into OmniChunks.

    Keeps per-stream state: an incremental UTF-8 decoder (a text delta may, in principle, end inside a
    multi-byte character), the finish_reason seen before the final flag (a model may send it in its last
    data response and the final flag in an empty one) and the latest usage report, which every chunk
    carries from the response that brought it on (the prompt's part comes with the first output).
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def decode(self, result) -> tuple[OmniChunk, bool]:
        """(chunk, is_final); the chunk's finish_reason is set only on the final one."""
        text = self._utf8.decode(b"".join(_bytes(result, "text")))
        ids = result.as_numpy("token_ids")
        audio = result.as_numpy("audio")
        finish = _bytes(result, "finish_reason")
        usage = _bytes(result, "usage")
        if finish:
            self.finish_reason = finish[0].decode("utf-8")
        if usage:
            self.usage = json.loads(usage[0])
        final = _is_final(result)
        chunk = OmniChunk(
            text=text,
            token_ids=[] if ids is None else [int(t) for t in ids.reshape(-1)],
            audio=None if audio is None or audio.size == 0 else audio.reshape(-1).astype(np.float32, copy=False),
            usage=self.usage,
        )
        if final:
            chunk.text += self._utf8.decode(b"", final=True)
            chunk.finish_reason = self.finish_reason or "stop"
        return chunk, final


def _bytes(result, name: str) -> list[bytes]:
    array = result.as_numpy(name)
    if array is None:
        return []
    return [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in array.reshape(-1)]


def _is_final(result) -> bool:
    flag = result.get_response().parameters.get("triton_final_response")
    return bool(flag is not None and flag.bool_param)
