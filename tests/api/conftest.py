from __future__ import annotations

import httpx
import pytest

from openai_frontend.app import create_app

from .fake_omni import FakeOmniClient
from .servers import ThreadedUvicorn


@pytest.fixture(scope="session")
def fake() -> FakeOmniClient:
    return FakeOmniClient()


@pytest.fixture(scope="session")
def server(fake):
    """The frontend over the fake backend, served by uvicorn on a loopback port, shared by all tests."""
    with ThreadedUvicorn(create_app(fake, default_voice="ethan")) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _fresh_fake(fake):
    fake.reset()
    yield


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


@pytest.fixture(scope="session")
def openai_client(server):
    from openai import OpenAI

    with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


@pytest.fixture
def async_openai(server):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=10)


@pytest.fixture
def anyio_backend():
    return "asyncio"  # grpc.aio and uvicorn need asyncio
