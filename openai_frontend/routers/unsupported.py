# OpenAI endpoints this server does not offer, answered with a 400 that says what to use instead (rather
# than a bare 404 that looks like a wrong base URL).
from __future__ import annotations

from fastapi import APIRouter

from openai_frontend.errors import FrontendError

router = APIRouter()

_INSTEAD = {
    "/v1/completions": "Qwen3-Omni is a chat model: use POST /v1/chat/completions with messages",
}


def _reject(path: str):
    async def endpoint() -> None:
        raise FrontendError(400, f"{path} is not supported; {_INSTEAD[path]}", code="unsupported_endpoint")

    return endpoint


for _path in _INSTEAD:
    router.add_api_route(_path, _reject(_path), methods=["POST"], include_in_schema=False)
