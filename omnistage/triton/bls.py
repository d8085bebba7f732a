# StageClient over Triton BLS: how omni_ensemble reaches thinker, talker and code2wav inside the server.
# Tensors go out where they are (GPU tensors through DLPack) and come back as copies that own their memory
# (_read says why); every request parameter is sent as a string, since BLS parameters take str/int/bool
# only and the stages coerce them back. Every stream is read
# to its end and its iterator handed to the reaper, which drops it once the 2.51 stub's native thread has
# let go of it (iterator_reaper.py says why). Every call also asks the stage for its host tensors as BF16
# views of their bytes, for which the stub makes no numpy array of the data (core/bf16_bytes.py).
from __future__ import annotations

from typing import Iterator

import torch
import triton_python_backend_utils as pb_utils

from ..core.errors import STUB_DEAD_MARK, EngineError, OmniError, StageUnavailableError, from_wire
from ..core.protocol import BLS_TRANSPORT, BLS_TRANSPORT_BF16_BYTES, CODE2WAV, TALKER, THINKER, TensorSpec
from ..pipeline.replicas import ReplicaRouter
from .iterator_reaper import IteratorReaper
from .tensors import bls_output, from_torch
from .workarounds import NOT_READY

def stage_error(message: str) -> OmniError:
    """Stages prefix error messages with the HTTP status (core/errors.py); keep it, and the request field at
    fault, so a client still sees a 400 as a 400."""
    wire = from_wire(message)
    if STUB_DEAD_MARK in message or (wire is None and NOT_READY.search(message)):
        # a dead or reloading stage is the server's outage, not a failure of this request
        return StageUnavailableError(f"stage unavailable (being restarted): {wire or message}")
    return wire or EngineError(message)


def _parameters(values: dict) -> dict:
    return {k: (v if isinstance(v, (bool, str)) else str(v)) for k, v in values.items() if v is not None}


def _read(response, outputs: dict[str, TensorSpec]) -> dict:
    if response.has_error():
        raise stage_error(response.error().message())
    out = {}
    for t in response.output_tensors():
        value = bls_output(t, outputs[t.name()].data_type)
        # Own the memory of every tensor, GPU (Triton's CUDA pool, reused once the response is gone) and host
        # (the response's shared memory) alike. A view would keep the response's tensor alive through DLPack
        # past the moment the reaper drops the stream's iterator (iterator_reaper.py), so the tensor would be
        # released later, on whichever thread let go of the view, outside that protocol. Stage outputs come in
        # host memory, so without the clone every frame and text row would be such a view; the server freeze
        # seen with them had omni_ensemble's threads stuck right here (the sweep that froze at 32 in
        # perf/results/h200-handoff-variants.json).
        out[t.name()] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


class BlsStageClient:
    """replicas: stage -> model names of its replicas (thinker, talker, code2wav; see pipeline/replicas.py).
    reaper: keeps each finished stream's iterator until the stub has let go of it (iterator_reaper.py)."""

    def __init__(self, reaper: IteratorReaper, replicas: dict[str, list[str]] | None = None):
        self.reaper = reaper
        self.routers = {s: ReplicaRouter((replicas or {}).get(s) or [s]) for s in ("thinker", "talker", "code2wav")}

    def _stream(self, model: str, outputs, inputs: dict, parameters: dict) -> Iterator[dict]:
        """Sends the request now and returns an iterator over its outputs; the 2.51 stub's exec() returns
        once the first response is in, so the call waits that long. Sending at call time orders a session's
        calls as the caller makes them: the talker's start reaches the stage before the appends that the
        thinker's thread sends while the talker's own thread has not begun reading yet (a generator would
        send only on its first read, and the stage drops appends to a stream it does not know)."""
        request = pb_utils.InferenceRequest(
            model_name=model,
            inputs=[from_torch(k, v) for k, v in inputs.items() if v is not None],
            requested_output_names=[t.name for t in outputs],
            parameters=_parameters(dict(parameters, **{BLS_TRANSPORT: BLS_TRANSPORT_BF16_BYTES})),
        )
        return self._responses(request.exec(decoupled=True), {t.name: t for t in outputs})

    def _responses(self, responses, specs: dict[str, TensorSpec]) -> Iterator[dict]:
        try:
            for response in responses:
                out = _read(response, specs)
                if out:
                    yield out
        finally:
            # Read to the end even after an error or a consumer that stopped early: a 2.51 iterator dropped
            # before its final response is never cleaned up. Then it is the reaper's to drop (see there).
            for _ in responses:
                pass
            self.reaper.hold(responses)

    def thinker(self, session: str, inputs: dict, parameters: dict) -> Iterator[dict]:
        model = self.routers["thinker"].pin(session)
        return self._stream(model, THINKER.outputs, inputs, dict(parameters, session=session))

    def talker(self, session: str, inputs: dict, parameters: dict) -> Iterator[dict]:
        model = self.routers["talker"].pin(session)
        return self._stream(model, TALKER.outputs, inputs, dict(parameters, session=session, action="start"))

    def talker_append(self, session: str, rows: torch.Tensor | None, end: bool) -> None:
        inputs = {"text_rows": rows} if rows is not None and rows.shape[0] else {}
        model = self.routers["talker"].pin(session)  # pinned by talker() already
        for _ in self._stream(model, (), inputs, {"session": session, "action": "append", "text_end": end}):
            pass

    def abort(self, stage: str, session: str) -> None:
        router = self.routers[stage]
        pinned = router.get(session)
        for model in [pinned] if pinned else router.replicas:  # not pinned (yet): whichever may hold it
            for _ in self._stream(model, (), {}, {"session": session, "action": "abort"}):
                pass

    def code2wav(self, session: str, codes: torch.Tensor | None, start: bool, end: bool) -> torch.Tensor:
        model = self.routers["code2wav"].pin(session)  # the replica that holds the stream's state
        inputs = {"codes": codes} if codes is not None else {}
        parameters = {"session": session, "action": "start" if start else "append", "end": end}
        audio = None
        for out in self._stream(model, CODE2WAV.outputs, inputs, parameters):
            audio = out.get("audio", audio)
        if audio is None and codes is not None:
            raise EngineError("code2wav returned no audio")
        return torch.zeros(0) if audio is None else audio  # an end with no frames has no samples

    def placement(self, session: str) -> dict[str, str]:
        """The replica of each stage that serves the session (reported in usage)."""
        return {stage: model for stage, router in self.routers.items() if (model := router.get(session))}

    def release(self, session: str) -> None:
        """The session is over: it stops counting towards its replicas' load."""
        for router in self.routers.values():
            router.release(session)
