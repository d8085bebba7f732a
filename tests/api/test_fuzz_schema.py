# Schema-based fuzzing (schemathesis over the app's own OpenAPI schema, valid and invalid bodies): no
# input gives a 5xx, every error uses OpenAI's error object, and the app still serves afterwards.
# CI-sized: a few hundred generated requests, in-process over ASGI with the fake backend.
import schemathesis
from hypothesis import HealthCheck, settings

from openai_frontend.app import create_app
from openai_frontend.settings import FrontendSettings

from .fake_omni import FakeOmniClient

BACKEND = FakeOmniClient()
APP = create_app(BACKEND, FrontendSettings(max_body_bytes=256 * 1024))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case):
    BACKEND.reset()
    _mostly_valid_names(case.body)
    response = case.call()
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text[:500]


def _mostly_valid_names(body) -> None:
    # Random strings are never the served model or a voice, so every request would stop at that check;
    # naming them right lets generated requests reach the backend and the response rendering too.
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = "qwen3-omni"
    for holder, key in ((body, "speaker"), (body, "voice"), (body.get("audio"), "voice")):
        if isinstance(holder, dict) and isinstance(holder.get(key), str):
            holder[key] = "ethan"


def test_fuzzed_app_still_serves():
    from starlette.testclient import TestClient

    with TestClient(APP) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "modalities": ["text"]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world"
