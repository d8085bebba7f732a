# POST /v1/chat/completions
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omnistage.core.protocol import SAMPLE_RATE

from openai_frontend import chat_service
from openai_frontend.chat_params import plan_chat
from openai_frontend.chat_render import ResponseIds
from openai_frontend.errors import error_response
from openai_frontend.metrics import RequestMeter
from openai_frontend.schemas import ChatCompletionRequest
from openai_frontend.sse import ClientDisconnected, SSEResponse, cancel_on_disconnect

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    settings, client, store = request.app.state.settings, request.app.state.client, request.app.state.audio_store
    plan = await plan_chat(body, settings, store)
    ids = ResponseIds(model=plan.model)
    arrival = getattr(request.state, "arrival", None) or time.perf_counter()
    meter = RequestMeter(request.app.state.metrics, arrival, SAMPLE_RATE, request_id=ids.id)
    if plan.stream:
        return SSEResponse(chat_service.stream_events(client, plan, ids, meter, store), on_error=error_response)
    try:
        # uvicorn does not cancel a handler whose client left; without this a long spoken answer
        # would be generated to the end for nobody
        result = await cancel_on_disconnect(request.receive, chat_service.complete(client, plan, ids, meter, store))
    except ClientDisconnected:
        return Response(status_code=499)  # never delivered
    return JSONResponse(result)
