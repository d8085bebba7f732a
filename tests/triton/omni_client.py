# A small test client for omni_ensemble over tritonclient's gRPC stream: collects text, audio chunks
# and the final response, with arrival times.
from __future__ import annotations

import json
import queue
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient


@dataclass
class OmniResult:
    text: str = ""
    token_ids: list = field(default_factory=list)
    audio: list = field(default_factory=list)  # float32 chunks
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    events: list = field(default_factory=list)  # (seconds since start, "text" | "audio")

    @property
    def waveform(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)


def messages_input(messages) -> grpcclient.InferInput:
    data = np.array([json.dumps(messages).encode()], dtype=np.object_)
    inp = grpcclient.InferInput("messages", [1], "BYTES")
    inp.set_data_from_numpy(data)
    return inp


def _string(result, name):
    value = result.as_numpy(name)
    return None if value is None else value.reshape(-1)[0].decode()


class OmniStream:
    """One request on its own gRPC stream; `cancel()` drops it mid-way like a disconnecting client."""

    def __init__(self, url: str, messages, parameters: dict, model: str = "omni_ensemble"):
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.result = OmniResult()
        self.start = time.perf_counter()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))
        self.client.async_stream_infer(model, [messages_input(messages)], request_id=uuid.uuid4().hex,
                                       parameters=parameters, enable_empty_final_response=True)  # fmt: skip

    def next(self, timeout: float = 120) -> bool:
        """Reads one response; False once the stream has ended."""
        result, error = self.responses.get(timeout=timeout)
        r = self.result
        if error is not None:
            r.error = str(error)
            return False
        t = time.perf_counter() - self.start
        text, ids, audio = _string(result, "text"), result.as_numpy("token_ids"), result.as_numpy("audio")
        if ids is not None and len(ids):
            r.text += text or ""
            r.token_ids += ids.tolist()
            r.events.append((t, "text"))
        if audio is not None and len(audio):
            r.audio.append(audio.astype(np.float32))
            r.events.append((t, "audio"))
        if (reason := _string(result, "finish_reason")) is not None:
            r.finish_reason = reason
        if (usage := _string(result, "usage")) is not None:
            r.usage = json.loads(usage)
        final = result.get_response().parameters.get("triton_final_response")
        return not (final is not None and final.bool_param)

    def run(self, timeout: float = 120) -> OmniResult:
        deadline = time.time() + timeout
        while self.next(max(0.1, deadline - time.time())):
            pass
        self.close()
        return self.result

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def omni(url: str, messages, parameters: dict, timeout: float = 120) -> OmniResult:
    return OmniStream(url, messages, parameters).run(timeout)
