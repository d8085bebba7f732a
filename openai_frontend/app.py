# The FastAPI application: state (backend client, settings), error handlers, routers.
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from openai_frontend.errors import install_error_handlers
from openai_frontend.omni_client import OmniClient
from openai_frontend.routers import chat, system
from openai_frontend.settings import FrontendSettings


def create_app(client: OmniClient, *, default_voice: str = "ethan", model_name: str = "qwen3-omni") -> FastAPI:
    """The app serving `client`; it takes ownership of the client and closes it at shutdown."""
    settings = FrontendSettings(model_name=model_name, default_voice=default_voice.lower())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.close()

    app = FastAPI(title="omnistage OpenAI frontend", lifespan=lifespan)
    app.state.client = client
    app.state.settings = settings
    install_error_handlers(app)
    app.include_router(system.router)
    app.include_router(chat.router)
    return app
