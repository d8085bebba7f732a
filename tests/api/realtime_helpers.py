# Shared by the realtime tests: a frontend over any OmniClient with chosen limits, the openai SDK's
# realtime client against it, and ways to wait for events.
from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from openai_frontend.app import create_app
from openai_frontend.realtime.connection import RealtimeLimits
from openai_frontend.settings import FrontendSettings
from perf.realtime_load import pcm16, speech_like

from .fake_omni import FakeOmniClient
from .servers import ThreadedUvicorn

KEY = "sk-test-realtime"
WAIT_S = 20
SERVER_EVENT = TypeAdapter(RealtimeServerEvent)


def serve(client, limits: RealtimeLimits | None = None, api_key: str | None = KEY) -> ThreadedUvicorn:
    app = create_app(client, FrontendSettings(api_key=api_key))
    app.state.realtime_limits = limits or RealtimeLimits()
    return ThreadedUvicorn(app)


@pytest.fixture(scope="module")
def fake():
    """One scripted backend per test module."""
    return FakeOmniClient()


@pytest.fixture(scope="module")
def server(fake):
    """The frontend over the module's scripted backend."""
    with serve(fake) as srv:
        yield srv


def sdk(url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def until(conn, kind: str, seen: list | None = None, timeout: float = WAIT_S):
    """Events up to and including the first of type `kind` (each appended to `seen` too). Each event is
    validated against the SDK's server event types first (the SDK itself builds them without checks)."""
    async with asyncio.timeout(timeout):
        while True:
            raw = await conn.recv_bytes()
            SERVER_EVENT.validate_json(raw)
            event = conn.parse_event(raw)
            if seen is not None:
                seen.append(event)
            if event.type == kind:
                return event


def utterance(seconds: float = 1.0, silence_s: float = 0.8, f0: float = 140.0) -> bytes:
    """24 kHz pcm16: a short lead-in of silence, speech-like sound, then enough silence to end the turn."""
    lead = np.zeros(int(0.2 * 24000), dtype=np.float32)
    tail = np.zeros(int(silence_s * 24000), dtype=np.float32)
    return pcm16(np.concatenate([lead, speech_like(seconds, f0=f0), tail]))


async def stream_audio(conn, pcm: bytes, chunk_ms: int = 100, pace_s: float = 0.0) -> None:
    step = 24000 * 2 * chunk_ms // 1000
    for i in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + step]).decode())
        if pace_s:
            await asyncio.sleep(pace_s)
