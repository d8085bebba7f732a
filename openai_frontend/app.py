# The FastAPI application: state (backend client, settings, metrics), middleware, error handlers, routers.
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from openai_frontend.errors import install_error_handlers
from openai_frontend.metrics import FrontendMetrics
from openai_frontend.middleware import ApiKeyGuard, BodyLimit, RequestAccounting
from openai_frontend.omni_client import OmniClient
from openai_frontend.routers import chat, metrics, system, unsupported
from openai_frontend.settings import FrontendSettings


def create_app(
    client: OmniClient,
    settings: FrontendSettings | None = None,
    *,
    default_voice: str = "ethan",
    model_name: str = "qwen3-omni",
) -> FastAPI:
    """The app serving `client`; it takes ownership of the client and closes it at shutdown.

    `settings` defaults to FrontendSettings(model_name=..., default_voice=...)."""
    settings = settings or FrontendSettings(model_name=model_name, default_voice=default_voice)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.close()

    app = FastAPI(title="omnistage OpenAI frontend", lifespan=lifespan)
    app.state.client = client
    app.state.settings = settings
    app.state.metrics = FrontendMetrics()
    install_error_handlers(app)
    for router in (system.router, metrics.router, chat.router, unsupported.router):
        app.include_router(router)
    # added last = outermost: accounting sees every answer, including 401 and 413
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyGuard, api_key=settings.api_key)
    app.add_middleware(RequestAccounting, metrics=app.state.metrics)
    return app
