# A client that goes away cancels the backend stream (the fake sees its generator closed or cancelled).
import asyncio

import httpx
import pytest

from .fake_omni import Script, Step, tone

USER = [{"role": "user", "content": "Tell me a long story."}]
WAIT_S = 5


def test_stream_closed_by_the_openai_client(openai_client, http, fake):
    fake.script = Script(steps=[Step("Once", audio=tone(1920)), Step(" upon")], hang=True)
    stream = openai_client.chat.completions.create(model="qwen3-omni", messages=USER, stream=True)
    seen = ""
    for chunk in stream:
        audio = chunk.choices[0].delta.audio
        seen += (audio.transcript or "") if audio else ""  # with audio on, the text is the transcript
        if seen == "Once upon":
            break
    assert not fake.cancelled.is_set()
    stream.close()
    assert fake.cancelled.wait(WAIT_S)
    assert not fake.finished.is_set()
    assert http.get("/health").status_code == 200


def test_stream_dropped_while_backend_is_silent(server, fake):
    # the backend produces nothing after the first delta: only a disconnect watcher can notice
    fake.script = Script(steps=[Step("Hi")], hang=True)
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as c:
        with c.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
            for line in r.iter_lines():
                if '"transcript":"Hi"' in line:
                    break
    assert fake.cancelled.wait(WAIT_S)


def test_stream_dropped_before_the_first_response(server, fake):
    fake.script = Script(steps=[Step("late", delay_s=60)])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json={"messages": USER, "stream": True}, timeout=0.3)
    assert fake.cancelled.wait(WAIT_S)


def test_non_stream_dropped(server, fake):
    fake.script = Script(steps=[Step("Once")], hang=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json={"messages": USER}, timeout=0.3)
    assert fake.cancelled.wait(WAIT_S)


@pytest.mark.anyio
async def test_one_disconnect_leaves_other_streams_alone(server, fake):
    fake.script = Script(steps=[Step("a", delay_s=0.05), Step("b", delay_s=0.05), Step("c", delay_s=0.05)])

    async def full(c: httpx.AsyncClient) -> str:
        async with c.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True, "modalities": ["text"]}) as r:
            return "".join([line async for line in r.aiter_lines()])

    async def dropped(c: httpx.AsyncClient) -> None:
        async with c.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
            async for line in r.aiter_lines():
                if '"transcript":"a"' in line:
                    return

    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as c:
        results = await asyncio.gather(*(full(c) for _ in range(6)), dropped(c))
    for body in results[:6]:
        assert '"content":"a"' in body and '"content":"c"' in body and body.endswith("data: [DONE]")
    assert fake.cancelled.wait(WAIT_S)
    assert len(fake.calls) == 7
