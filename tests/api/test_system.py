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


def test_models_list_both_served_names(openai_client):
    # vLLM-Omni's clients send the Hugging Face name; the short one is ours
    models = openai_client.models.list().data
    assert [m.id for m in models] == ["Qwen/Qwen3-Omni-30B-A3B-Instruct", "qwen3-omni"]
    assert {(m.object, m.owned_by) for m in models} == {("model", "omnistage")}
    assert openai_client.models.retrieve("qwen3-omni").id == "qwen3-omni"
    assert openai_client.models.retrieve("Qwen/Qwen3-Omni-30B-A3B-Instruct").id == "Qwen/Qwen3-Omni-30B-A3B-Instruct"
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.models.retrieve("gpt-4o")
    assert (e.value.body["param"], e.value.body["code"]) == ("model", "model_not_found")


def test_an_unknown_long_model_name_is_not_echoed_whole(openai_client):
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.models.retrieve("m" * 5000)
    message = e.value.body["message"]
    assert "m" * 80 + "..." in message and "m" * 81 not in message
    assert "'qwen3-omni'" in message


@pytest.mark.parametrize("model", ["Qwen/Qwen3-Omni-30B-A3B-Instruct", "qwen3-omni", None])
def test_a_reply_names_the_model_its_request_sent(http, model):
    body = {"messages": [{"role": "user", "content": "hi"}], "modalities": ["text"]}
    r = http.post("/v1/chat/completions", json=body if model is None else {**body, "model": model})
    assert r.status_code == 200 and r.json()["model"] == (model or "Qwen/Qwen3-Omni-30B-A3B-Instruct")


def test_unknown_model_is_a_404_listing_the_served_names(http):
    r = http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'Qwen/Qwen3-Omni-30B-A3B-Instruct', 'qwen3-omni'" in r.json()["error"]["message"]
