# Hostile requests the frontend itself must refuse with a 4xx OpenAI error, before the backend sees them,
# keeping the server healthy: oversized bodies (declared or not), deep nesting, non-UTF-8, wrong types,
# absurd lengths. (Media that only omni_ensemble decodes is covered in tests/triton/test_reliability.py.)
import pytest

from perf.soak_inputs import BAD_INPUTS, FRONTEND_ONLY


@pytest.mark.parametrize("name", FRONTEND_ONLY)
def test_refused_with_4xx_and_server_stays_healthy(http, fake, name):
    content, headers = BAD_INPUTS[name]
    r = http.post("/v1/chat/completions", content=content(), headers=headers, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert fake.calls == []
    assert http.get("/health").status_code == 200


def test_oversized_body_without_content_length_is_413(http, fake):
    def chunks():  # chunked transfer: no Content-Length to refuse on
        for _ in range(80):
            yield b"a" * (1 << 20)

    r = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["message"]
    assert fake.calls == []
