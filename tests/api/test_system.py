import openai
import pytest


def test_health_follows_backend_readiness(http, fake):
    assert http.get("/health").status_code == 200
    fake.is_ready = False
    r = http.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "unavailable"}


def test_health_when_readiness_check_raises(http, fake, monkeypatch):
    async def broken():
        raise RuntimeError("channel closed")

    monkeypatch.setattr(fake, "ready", broken)
    assert http.get("/health").status_code == 503


def test_models(openai_client):
    (model,) = openai_client.models.list().data
    assert (model.id, model.object, model.owned_by) == ("qwen3-omni", "model", "omnistage")
    assert openai_client.models.retrieve("qwen3-omni").id == "qwen3-omni"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("gpt-4o")
