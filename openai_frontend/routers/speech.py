# POST /v1/audio/speech
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from omnistage.core.protocol import SAMPLE_RATE

from openai_frontend import speech
from openai_frontend.chat_params import plan_chat
from openai_frontend.errors import error_response
from openai_frontend.metrics import RequestMeter
from openai_frontend.sse import SSEResponse

router = APIRouter()


@router.post("/v1/audio/speech", response_class=Response)
async def create_speech(body: speech.SpeechRequest, request: Request) -> Response:
    settings = request.app.state.settings
    plan = await plan_chat(speech.chat_request(body, settings), settings)
    request_id = f"speech-{uuid.uuid4().hex}"
    meter = RequestMeter(request.app.state.metrics, getattr(request.state, "arrival", None) or time.perf_counter(),
                         SAMPLE_RATE, request_id=request_id)  # fmt: skip
    chunks = speech.audio_bytes(request.app.state.client, plan, request_id, meter)
    # the disconnect guard of the SSE responses: a client that leaves cancels the Triton request
    return SSEResponse(chunks, on_error=error_response, media_type=speech.media_type(plan.audio_format))
