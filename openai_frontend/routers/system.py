# GET /health, GET /v1/models, GET /v1/models/{model}
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from openai_frontend.chat_params import served_model

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    # `python -m openai_frontend` probes every Triton model (stage_watchdog.py): ready only while every
    # model is READY and answered its latest probe; the per-model state is in the body.
    client = request.app.state.client
    try:
        ready = await client.ready()
    except Exception:  # noqa: BLE001 - any failure to answer means not ready
        ready = False
    body = {"status": "ok" if ready else "unavailable"}
    if (report := client.health_report()) is not None:
        body["models"] = report
    return JSONResponse(body, status_code=200 if ready else 503, headers=None if ready else {"Retry-After": "5"})


def _model_card(name: str, settings) -> dict:
    return {"id": name, "object": "model", "created": settings.created, "owned_by": "omnistage"}


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    settings = request.app.state.settings
    return JSONResponse({"object": "list", "data": [_model_card(n, settings) for n in settings.served_model_names]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    settings = request.app.state.settings
    return JSONResponse(_model_card(served_model(model, settings), settings))
