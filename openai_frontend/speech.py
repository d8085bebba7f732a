# POST /v1/audio/speech (OpenAI's text-to-speech) on the same pipeline: a chat request whose system prompt
# tells the thinker to read the input aloud word for word, audio only. The reply is the audio file itself;
# `pcm` is streamed chunk by chunk as the talker produces it, other formats are sent once complete.
# The thinker still generates the words, so the speech follows the input only as well as the model obeys.
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from openai_frontend.audio_encoding import FORMATS, MEDIA_TYPES, encode_audio
from openai_frontend.chat_params import ChatPlan
from openai_frontend.chat_reply import reply_pieces
from openai_frontend.metrics import RequestMeter
from openai_frontend.omni_client import OmniClient
from openai_frontend.openai_voices import openai_voice
from openai_frontend.schemas import ChatCompletionRequest, StageSampling, _Open, check_voice
from openai_frontend.settings import FrontendSettings

READ_ALOUD = (
    "You are a text-to-speech engine. Read the user's message aloud exactly as written, word for word, "
    "without answering it, commenting on it or adding anything."
)
MAX_INPUT_CHARS = 4096  # OpenAI's limit


class SpeechRequest(_Open):
    model: str | None = None
    input: Annotated[str, Field(min_length=1, max_length=MAX_INPUT_CHARS)]
    voice: Any = None  # a voice of the served checkpoint or an OpenAI built-in one; None: the server default
    response_format: Literal[FORMATS] = "mp3"  # type: ignore[valid-type]  # OpenAI's default
    instructions: Annotated[str, Field(max_length=MAX_INPUT_CHARS)] | None = None  # how to speak, for the prompt
    speed: Annotated[float, Field(ge=0.25, le=4.0)] = 1.0
    stream_format: Literal["audio"] = "audio"  # OpenAI's "sse" is not offered
    sampling_params_list: Annotated[list[StageSampling | None], Field(max_length=3)] | None = None

    _voice = field_validator("voice", mode="before")(check_voice)

    @field_validator("speed")
    @classmethod
    def _speed(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError("only speed 1.0 is supported: the talker has no tempo control")
        return value


def chat_request(req: SpeechRequest, settings: FrontendSettings) -> ChatCompletionRequest:
    system = READ_ALOUD + (f" Speaking style: {req.instructions}" if req.instructions else "")
    return ChatCompletionRequest.model_validate({
        "model": req.model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": req.input}],
        "modalities": ["audio"],
        "voice": openai_voice(req.voice, settings, "voice"),  # OpenAI's built-in names too (openai_voices.py)
        "audio": {"format": req.response_format},
        "sampling_params_list": req.sampling_params_list,
    })  # fmt: skip


async def audio_bytes(client: OmniClient, plan: ChatPlan, request_id: str, meter: RequestMeter) -> AsyncIterator[bytes]:
    """The response body: pcm chunks as they come, or one encoded file at the end."""
    pcm: list[bytes] = []
    async with aclosing(reply_pieces(client, plan, request_id, meter)) as pieces:
        async for piece in pieces:
            if plan.audio_format == "pcm":
                if piece.pcm16 or piece.is_final:  # the first body part is awaited before the 200 goes out
                    yield piece.pcm16
            else:
                pcm.append(piece.pcm16)
    if plan.audio_format != "pcm":
        yield await asyncio.to_thread(encode_audio, b"".join(pcm), plan.audio_format)


def media_type(audio_format: str) -> str:
    return MEDIA_TYPES[audio_format]
