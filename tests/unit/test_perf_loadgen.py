# perf/loadgen.py over the real FastAPI frontend (ASGI, in process) with a scripted backend: SSE parsing,
# the per-request times, errors counted rather than raised, and the level deadline.
import asyncio
import base64
import json

import httpx
import pytest

from omnistage.core.errors import EngineError
from openai_frontend.app import create_app
from perf import workloads
from perf.loadgen import run_level
from perf.metrics import RequestRecord
from perf.sse_client import apply_event
from tests.api.fake_omni import FakeOmniClient, Script, Step, tone


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


def level(fake, concurrency, n, timeout_s=None):
    transport = httpx.ASGITransport(app=create_app(fake, default_voice="ethan", model_name="qwen3-omni"))
    return asyncio.run(
        run_level("http://frontend", small_workload(), concurrency, n, timeout_s=timeout_s, transport=transport)
    )


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
