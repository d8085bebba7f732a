# /metrics, the API key, the request body limit and the endpoints answered with a 400, over uvicorn.
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from openai_frontend.app import create_app
from openai_frontend.settings import FrontendSettings

from .fake_omni import FakeOmniClient, Script, Step, tone
from .servers import ThreadedUvicorn

USER = [{"role": "user", "content": "hi"}]


def scrape(http) -> dict[tuple[str, tuple], float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}  # fmt: skip


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_requests(http, openai_client, fake):
    before = scrape(http)
    fake.script = Script(steps=[Step("Hi", delay_s=0.05), Step("", audio=tone(1920 * 5)), Step("", audio=tone(1920 * 5))])
    openai_client.chat.completions.create(model="qwen3-omni", messages=USER)
    list(openai_client.chat.completions.create(model="qwen3-omni", messages=USER, stream=True))
    http.post("/v1/chat/completions", json={"messages": []})
    after = scrape(http)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    route = "/v1/chat/completions"
    assert delta("omni_frontend_requests_total", route=route, status="200") == 2
    assert delta("omni_frontend_requests_total", route=route, status="400") == 1
    for name in ("time_to_first_token_seconds", "audio_ttfp_seconds", "e2e_seconds", "queue_seconds", "rtf"):
        assert delta(f"omni_frontend_{name}_count") == 2, name
    assert delta("omni_frontend_audio_seconds_total") == pytest.approx(2 * 10 * 1920 / 24000)
    assert delta("omni_frontend_audio_frames_total") == 20 and delta("omni_frontend_prompt_tokens_total") == 14
    assert delta("omni_frontend_time_to_first_token_seconds_sum") >= 2 * 0.05  # the fake's delay is in there
    assert value(after, "omni_frontend_requests_in_flight") == 0
    rtf = delta("omni_frontend_rtf_sum") / 2
    assert 0 < rtf < 1  # 0.8 s of audio in about 0.05 s


def test_in_flight_counts_open_streams(http, fake):
    fake.script = Script(steps=[Step("a")], hang=True)
    with httpx.Client(base_url=str(http.base_url), timeout=10) as other:
        with other.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            assert value(scrape(http), "omni_frontend_requests_in_flight") == 1
    assert fake.cancelled.wait(5)
    assert value(scrape(http), "omni_frontend_requests_in_flight") == 0


@pytest.mark.parametrize("path", ["/v1/completions"])
def test_unsupported_endpoints_say_what_to_use(http, fake, path):
    r = http.post(path, json={"model": "qwen3-omni", "prompt": "hi", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_endpoint"
    assert "/v1/chat/completions" in r.json()["error"]["message"] and fake.calls == []


# ---- API key and body limit: an app of their own ------------------------------------------------------
@pytest.fixture(scope="module")
def guarded():
    backend = FakeOmniClient()
    settings = FrontendSettings(api_key="s3cret", max_body_bytes=4096)
    with ThreadedUvicorn(create_app(backend, settings)) as srv:
        yield srv, backend


@pytest.fixture(autouse=True)
def _fresh_guarded_backend(request):
    if "guarded" in request.fixturenames:
        request.getfixturevalue("guarded")[1].reset()


def test_api_key_required_on_v1(guarded):
    srv, backend = guarded
    for key in ("wrong", "s3cret2", ""):
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key or "x", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as info:
                client.chat.completions.create(model="qwen3-omni", messages=USER)
            assert info.value.body["code"] == "invalid_api_key"
    assert httpx.get(f"{srv.url}/v1/models").status_code == 401
    assert backend.calls == []
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0) as client:
        assert client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text"]).choices[0].message.content
    # probes and scrapers need no key
    assert httpx.get(f"{srv.url}/health").status_code == 200 and httpx.get(f"{srv.url}/metrics").status_code == 200


def test_body_limit(guarded):
    srv, backend = guarded
    auth = {"Authorization": "Bearer s3cret"}
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=big, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

    def chunked():  # no Content-Length: counted while read
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    r = httpx.post(f"{srv.url}/v1/chat/completions", content=chunked(), headers={**auth, "content-type": "application/json"})
    assert r.status_code == 413 and "larger than 4096 bytes" in r.json()["error"]["message"]
    assert backend.calls == []
    ok = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": USER, "modalities": ["text"]}, headers=auth)
    assert ok.status_code == 200


def test_flags_become_settings(monkeypatch):
    from openai_frontend.__main__ import parse_args, settings_from_args

    monkeypatch.setenv("OMNISTAGE_API_KEY", "from-env")
    s = settings_from_args(parse_args(["--voices", "Vivian,Ethan", "--default-voice", "VIVIAN", "--response-style",
                                       "vllm-omni", "--max-body-mb", "1", "--allow-remote-media"]))  # fmt: skip
    assert (s.voices, s.default_voice, s.response_style, s.api_key) == (("vivian", "ethan"), "vivian", "vllm-omni", "from-env")
    assert (s.max_body_bytes, s.fetch_remote_media, s.fetch_timeout_s) == (1 << 20, True, 10.0)
    served = settings_from_args(parse_args(["--served-model-name", "omni", "--served-model-name", "Qwen/X"]))
    assert served.served_model_names == ("omni", "Qwen/X")  # the flag replaces the default list
    assert settings_from_args(parse_args([])).served_model_names == ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "qwen3-omni")
    assert settings_from_args(parse_args(["--api-key", "flag"])).api_key == "flag"
    with pytest.raises(SystemExit, match="default_voice"):
        settings_from_args(parse_args(["--voices", "chelsie", "--default-voice", "ethan"]))
