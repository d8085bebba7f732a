# The FastAPI application: state (backend client, settings, metrics), middleware, error handlers, routers.
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from omnistage.core.voices import DEFAULT_VOICE

from openai_frontend.audio_store import AudioStore
from openai_frontend.errors import install_error_handlers
from openai_frontend.metrics import FrontendMetrics
from openai_frontend.middleware import ApiKeyGuard, BodyLimit, RequestAccounting
from openai_frontend.omni_client import OmniClient
from openai_frontend.routers import chat, metrics, realtime, speech, system, unsupported
from openai_frontend.settings import FrontendSettings

DEMO_DIR = Path(__file__).parent / "static"  # the browser demo; it calls only the public API


def create_app(
    client: OmniClient,
    settings: FrontendSettings | None = None,
    *,
    default_voice: str = DEFAULT_VOICE,
) -> FastAPI:
    """The app serving `client`; it takes ownership of the client and closes it at shutdown.

    `settings` defaults to FrontendSettings(default_voice=...)."""
    settings = settings or FrontendSettings(default_voice=default_voice)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await client.start()  # background work (stage probes, server probes) runs from the start
        yield
        await client.close()

    app = FastAPI(title="omnistage OpenAI frontend", lifespan=lifespan)
    app.state.client = client
    app.state.settings = settings
    app.state.metrics = FrontendMetrics()
    app.state.audio_store = AudioStore(max_items=settings.audio_keep_count, max_bytes=settings.audio_keep_bytes,
                                       ttl_s=settings.audio_keep_s)  # fmt: skip
    install_error_handlers(app)
    for router in (system.router, metrics.router, chat.router, speech.router, realtime.router, unsupported.router):
        app.include_router(router)
    app.add_api_route("/", _to_demo, include_in_schema=False)
    app.add_api_route("/demo", _to_demo, include_in_schema=False)
    app.mount("/demo/", StaticFiles(directory=DEMO_DIR, html=True), name="demo")
    # added last = outermost: accounting sees every answer, including 401 and 413
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyGuard, api_key=settings.api_key)
    app.add_middleware(RequestAccounting, metrics=app.state.metrics)
    return app


def _to_demo() -> RedirectResponse:
    return RedirectResponse("/demo/")  # with the slash: the page's links are relative to it
