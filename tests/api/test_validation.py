# Bad requests get 400 with OpenAI's error object, and the server keeps serving.
import pytest

USER = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}

BAD_BODIES = {
    "malformed json": (b'{"messages": [', None),
    "not an object": (b'[1, 2]', None),
    "empty body": (b"", None),
    "messages missing": ({"model": "qwen3-omni"}, "messages"),
    "messages empty": ({"messages": []}, "messages"),
    "messages not a list": ({"messages": "hi"}, "messages"),
    "role unknown": ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    "content wrong type": ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    "content part unknown": ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "x"}}]}]},
                             "messages[0].content"),
    "part type not a string": ({"messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]}, "messages[0].content"),
    "image_url without url": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                              "messages[0].content"),
    "temperature string": ({"messages": USER, "temperature": "hot"}, "temperature"),
    "temperature range": ({"messages": USER, "temperature": 9}, "temperature"),
    "max_tokens float": ({"messages": USER, "max_tokens": 3.5}, "max_tokens"),
    "stream not bool": ({"messages": USER, "stream": "yes"}, "stream"),
    "modality unknown": ({"messages": USER, "modalities": ["video"]}, "modalities[0]"),
    "modalities empty": ({"messages": USER, "modalities": []}, "modalities"),
    "voice unknown": ({"messages": USER, "audio": {"voice": "albert", "format": "wav"}}, "audio.voice"),
    "speaker unknown": ({"messages": USER, "speaker": "bob"}, "speaker"),
    "format unsupported": ({"messages": USER, "audio": {"voice": "ethan", "format": "aac"}}, "audio.format"),
    "stop empty": ({"messages": USER, "stop": ""}, "stop"),
    "response_style unknown": ({"messages": USER, "response_style": "x"}, "response_style"),
    "audio unknown key": ({"messages": USER, "audio": {"voice": "ethan", "speed": 2}}, "audio.speed"),
    "stream_options without stream": ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    "n > 1": ({"messages": USER, "n": 2}, "n"),
    "response_format json": ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
    "tool_choice names no tool": ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                                   "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    "tool message without id": ({"messages": [*USER, {"role": "tool", "content": "3"}]}, "messages[1]"),
    "assistant without content": ({"messages": [*USER, {"role": "assistant"}]}, "messages[1]"),
    "audio id unknown": ({"messages": [*USER, {"role": "assistant", "audio": {"id": "audio_nope"}}, *USER]},
                         "messages[1].audio.id"),
    "sampling_params_list typo": ({"messages": USER, "sampling_params_list": [{"temprature": 1}]}, "sampling_params_list[0].temprature"),
}


@pytest.mark.parametrize("body, param", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_request(http, fake, body, param):
    if isinstance(body, bytes):
        r = http.post("/v1/chat/completions", content=body, headers=JSON)
    else:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert error["code"]  # every 4xx says why in a machine-readable code
    assert fake.calls == []  # nothing reached the backend


def test_messages_of_interest(http):
    def message(body):
        return http.post("/v1/chat/completions", json={"messages": USER, **body}).json()["error"]["message"]

    assert "valid voices: chelsie, ethan, aiden" in message({"audio": {"voice": "albert", "format": "wav"}})
    assert "supported: wav, pcm, pcm16, flac, mp3, opus" in message({"audio": {"voice": "ethan", "format": "aac"}})
    assert "n > 1 is not supported" in message({"n": 3})
    assert "response_format 'json_schema' is not supported" in message({"response_format": {"type": "json_schema"}})
    assert "is unknown or has expired" in message({"messages": [{"role": "assistant", "audio": {"id": "x"}}, *USER]})
    malformed = http.post("/v1/chat/completions", content=b"{", headers=JSON).json()["error"]["message"]
    assert malformed.startswith("request body is not valid JSON")


def test_json_needs_its_content_type(http):
    # FastAPI's strict content type (a CSRF guard) is kept; the message says what to do
    r = http.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/chat/completions", 405), ("POST", "/v1/nope", 404),
                                                  ("GET", "/nope", 404)])
def test_routing_errors_use_the_openai_envelope(http, method, path, status):
    r = http.request(method, path, json={})
    assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] in ("not_found", "method_not_allowed")


def test_server_healthy_after_bad_requests(http, fake):
    for body, _ in BAD_BODIES.values():
        http.post("/v1/chat/completions", content=body if isinstance(body, bytes) else None,
                  json=None if isinstance(body, bytes) else body)
    assert http.get("/health").status_code == 200
    r = http.post("/v1/chat/completions", json={"messages": USER, "modalities": ["text"]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world"
