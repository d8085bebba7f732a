# perf/loadgen.py over the real FastAPI frontend (uvicorn on a loopback port) with a scripted backend: SSE
# parsing, the per-request times, errors counted rather than raised, the level deadline, and connections
# kept alive between a stream's requests.
import asyncio
import base64
import json

import pytest

from omnistage.core.errors import EngineError
from openai_frontend.app import create_app
from perf import workloads
from perf.loadgen import run_level
from perf.metrics import RequestRecord
from perf.sse_client import LineSplitter, apply_event
from tests.api.fake_omni import FakeOmniClient, Script, Step, tone
from tests.api.servers import ThreadedUvicorn


def small_workload():
    return workloads.Workload(
        name="t",
        description="test",
        reply_tokens=2,
        frames=3,
        concurrency=(1,),
        prompts=[[{"role": "user", "content": f"prompt {i}"}] for i in range(4)],
        prompt_tokens=[10] * 4,
    )


class ClientPorts:
    """ASGI wrapper that notes the client port of every HTTP request (one port per TCP connection) and sends
    the end of each response body a little after the rest, as a server may ([DONE] is not the body's end)."""

    def __init__(self, app) -> None:
        self.app, self.ports = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.ports.append(scope["client"][1])

        async def late_end(message):
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await asyncio.sleep(0.05)
            await send(message)

        await self.app(scope, receive, late_end)


def level(fake, concurrency, n, timeout_s=None, app_wrapper=None):
    app = create_app(fake, default_voice="ethan")
    with ThreadedUvicorn(app_wrapper(app) if app_wrapper else app) as server:
        return asyncio.run(run_level(server.url, small_workload(), concurrency, n, timeout_s=timeout_s))


def test_apply_event_reads_text_audio_usage_and_done():
    r = RequestRecord(index=0)
    pcm = base64.b64encode(b"\x00\x01" * 1920).decode()
    assert not apply_event(r, json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}), 0.01)
    assert r.ttft is None  # the empty role delta is not text
    apply_event(r, json.dumps({"choices": [{"delta": {"content": "Hi"}}]}), 0.1)
    apply_event(r, json.dumps({"choices": [{"delta": {"audio": {"id": "a", "data": pcm, "transcript": ""}}}]}), 0.3)
    apply_event(r, json.dumps({"choices": [{"delta": {"audio": {"id": "a", "data": pcm}}}]}), 0.5)
    apply_event(r, json.dumps({"choices": [{"delta": {}, "finish_reason": "length"}]}), 0.6)
    apply_event(
        r,
        json.dumps(
            {
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "completion_tokens_details": {"audio_tokens": 2}},
            }
        ),
        0.6,
    )
    assert apply_event(r, "[DONE]", 0.7)
    assert (r.ttft, r.ttfp, r.last_audio, r.audio_samples, r.audio_chunks) == (0.1, 0.3, 0.5, 3840, 2)
    assert (r.finish_reason, r.prompt_tokens, r.completion_tokens, r.audio_frames) == ("length", 5, 2, 2)
    assert r.rtf == pytest.approx(0.5 / (3840 / 24000))


def test_level_against_the_frontend():
    fake = FakeOmniClient()
    fake.script = Script(
        steps=[
            Step("Hi", delay_s=0.01),
            Step("!", audio=tone(1920), delay_s=0.02),
            Step("", audio=tone(3840), delay_s=0.02),
        ],
        finish_reason="length",
    )
    s = level(fake, 2, 4).summary()
    assert (s["completed"], s["failed"], s["cut_by_deadline"]) == (4, 0, 0)
    assert s["audio_s"]["mean"] == pytest.approx(5760 / 24000)
    assert s["ttft_ms"]["mean"] < s["ttfp_ms"]["mean"] <= s["e2e_ms"]["mean"]
    assert s["completion_tokens"]["mean"] == 3 and s["audio_frames"]["mean"] == 3
    assert s["throughput_rps"] > 0
    sent = fake.calls[0]["parameters"]
    assert (sent["max_tokens"], sent["talker_max_tokens"], sent["talker_ignore_eos"]) == (2, 3, True)
    assert sorted(c["messages"][0]["content"] for c in fake.calls) == [f"prompt {i}" for i in range(4)]


def test_errors_are_counted_not_raised():
    fake = FakeOmniClient()
    fake.script = Script(steps=[Step("Hi")], error=EngineError("talker failed"))
    s = level(fake, 1, 2).summary()
    assert s["completed"] == 0 and s["failed"] == 2
    assert any("talker failed" in e for e in s["errors"])
    fake.script = Script(steps=[Step("only text")])  # a stream without audio is a failed TTS request
    assert level(fake, 1, 1).summary()["errors"] == {"no audio in the response": 1}


def test_deadline_cuts_what_is_in_flight():
    fake = FakeOmniClient()
    fake.script = Script(steps=[Step("Hi", audio=tone(1920))], hang=True)
    result = level(fake, 2, 5, timeout_s=0.5)
    s = result.summary()
    assert s["completed"] == 0 and s["cut_by_deadline"] == 5 and s["sent"] == 2
    assert result.note and "deadline" in result.note
    assert s["ttfp_ms_incl_cut"] is None or s["ttfp_ms_incl_cut"]["n"] <= 2


def test_a_stream_keeps_its_connection_between_requests():
    fake = FakeOmniClient()
    fake.script = Script(steps=[Step("Hi", delay_s=0.01), Step("", audio=tone(1920), delay_s=0.01)])
    wrapped = []
    s = level(fake, 2, 8, app_wrapper=lambda app: wrapped.append(ClientPorts(app)) or wrapped[0]).summary()
    assert s["completed"] == 8
    assert len(wrapped[0].ports) == 8 and len(set(wrapped[0].ports)) <= 2


def test_line_splitter_joins_pieces_and_strips_crlf():
    lines = LineSplitter()
    long = "data: " + "A" * 300_000
    assert lines.feed(b"data: 1\r\n\r\ndata") == ["data: 1", ""]
    assert lines.feed(b": 2\n") == ["data: 2"]
    assert lines.feed(long[:1000].encode()) == []
    assert lines.feed(long[1000:].encode()) == []
    assert lines.feed(b"\n\n") == [long, ""]
