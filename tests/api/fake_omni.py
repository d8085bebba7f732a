# A scripted OmniClient: tests say what the backend streams (text deltas, audio chunks, delays, an
# error, a hang) and observe what the frontend sent and whether it cancelled the stream.
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistage.core.errors import OmniError
from openai_frontend.omni_client import OmniChunk, OmniClient


@dataclass
class Step:
    text: str = ""
    audio: np.ndarray | None = None
    delay_s: float = 0.0

    @property
    def token_ids(self) -> list[int]:
        return [ord(c) for c in self.text]  # one fake token per character


@dataclass
class Script:
    steps: list[Step] = field(default_factory=lambda: [Step("Hello"), Step(" world")])
    finish_reason: str = "stop"
    prompt_tokens: int = 7
    error: OmniError | None = None  # raised after the steps
    hang: bool = False  # after the steps, wait until cancelled

    @property
    def audio_frames(self) -> int:
        return sum(0 if s.audio is None else len(s.audio) // 1920 for s in self.steps)


def tone(samples: int, freq: float = 440.0, amp: float = 0.5, offset: int = 0) -> np.ndarray:
    t = (np.arange(samples) + offset) / 24000.0
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


class FakeOmniClient(OmniClient):
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.script = Script()
        self.is_ready = True
        self.calls: list[dict[str, Any]] = []  # {"messages", "parameters", "request_id"}
        self.cancelled = threading.Event()  # set when a stream was left before it finished
        self.finished = threading.Event()

    async def ready(self) -> bool:
        return self.is_ready

    async def stream(self, messages, parameters, *, request_id: str = ""):
        self.calls.append({"messages": messages, "parameters": dict(parameters), "request_id": request_id})
        script = self.script
        completed = False
        try:
            for i, step in enumerate(script.steps):
                if step.delay_s:
                    await asyncio.sleep(step.delay_s)
                last = i == len(script.steps) - 1 and script.error is None and not script.hang
                chunk = OmniChunk(text=step.text, token_ids=step.token_ids, audio=step.audio)
                if last:
                    chunk.finish_reason = script.finish_reason
                    chunk.usage = self._usage(script)
                    completed = True
                yield chunk
            if script.error is not None:
                completed = True
                raise script.error
            if script.hang:
                await asyncio.Event().wait()
            if not script.steps:
                completed = True
                yield OmniChunk(finish_reason=script.finish_reason, usage=self._usage(script))
        finally:
            (self.finished if completed else self.cancelled).set()

    @staticmethod
    def _usage(script: Script) -> dict[str, int]:
        tokens = sum(len(s.token_ids) for s in script.steps)
        return {"prompt_tokens": script.prompt_tokens, "completion_tokens": tokens, "audio_frames": script.audio_frames}
