# GET /health, GET /v1/models, GET /v1/models/{model}
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from openai_frontend.errors import FrontendError

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


def _model_card(settings) -> dict:
    return {"id": settings.model_name, "object": "model", "created": settings.created, "owned_by": "omnistage"}


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state.settings)]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    settings = request.app.state.settings
    if model != settings.model_name:
        raise FrontendError(404, f"model {model!r} not found", param="model", code="model_not_found")
    return JSONResponse(_model_card(settings))
