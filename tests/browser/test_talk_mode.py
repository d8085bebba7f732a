# Talk mode (static/realtime.js) in headless Chromium over /v1/realtime, against the frontend over a
# scripted backend: the fake microphone loops a spoken-like utterance and a pause, so the server's VAD
# hears a turn, the answer streams and plays, and the next loop's speech barges in: playback stops, the
# server cancels the response and the page reports what was heard with conversation.item.truncate.
import base64
import io
import wave

import numpy as np
import pytest

from omnistage.core.errors import StageUnavailableError
from openai_frontend.app import create_app
from openai_frontend.realtime.connection import RealtimeLimits
from perf.realtime_load import speech_like

from ..api.fake_omni import Script, Step, tone
from ..api.servers import ThreadedUvicorn
from .conftest import CHROMIUM, CHROMIUM_ARGS
from .test_demo_page import fake, server  # noqa: F401  (fixtures: the frontend over a scripted backend)

MIC_RATE = 48000


def mic_wav() -> bytes:
    """0.4 s quiet, 1.2 s of speech-like sound, 1.6 s quiet: one turn per loop of the fake microphone."""
    quiet = lambda s: np.zeros(int(s * MIC_RATE), np.float32)  # noqa: E731
    samples = np.concatenate([quiet(0.4), speech_like(1.2, MIC_RATE), quiet(1.6)])
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(MIC_RATE)
        w.writeframes(np.rint(samples * 32767).astype("<i2").tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    mic = tmp_path_factory.mktemp("mic") / "speech.wav"
    mic.write_bytes(mic_wav())
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM,
                                     args=[*CHROMIUM_ARGS, f"--use-file-for-fake-audio-capture={mic}"])  # fmt: skip
        yield browser
        browser.close()


def talk_state(page) -> dict:
    return page.evaluate("() => JSON.parse(JSON.stringify(talkState))")


def test_talk_hears_a_turn_plays_the_answer_and_is_interrupted(browser, server, fake, tmp_path):  # noqa: F811
    fake.reset()
    # an answer that keeps talking: 1 s of speech, then the backend holds the response open
    fake.script = Script(steps=[Step("Hel", audio=tone(12000)), Step("lo", audio=tone(12000), delay_s=0.1)], hang=True)
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(server.url)
        page.wait_for_function("() => demoState.model === 'Qwen/Qwen3-Omni-30B-A3B-Instruct'")
        page.select_option("#voice", "aiden")
        page.click("#talk")
        page.wait_for_function("() => talkState.status === 'listening'")
        page.wait_for_function("() => talkState.audioChunks > 0", timeout=30_000)  # the first answer plays
        page.wait_for_function("() => talkState.cancelled > 0 && talkState.truncations.length > 0", timeout=30_000)
        s = talk_state(page)
        page.screenshot(path=str(tmp_path / "talk.png"))
        page.click("#talk")  # end the conversation
        page.wait_for_function("() => talkState.status === 'off'")
    finally:
        page.close()
    assert not errors, errors
    assert s["speechStarted"] >= 2 and s["speechStopped"] >= 1 and s["error"] is None
    assert s["transcript"] == "Hello" and s["appended"] > 10
    assert fake.cancelled.wait(10)  # the barge-in cancelled the backend request
    first = fake.calls[0]
    assert first["parameters"]["speaker"] == "aiden"
    (part,) = first["messages"][0]["content"]
    heard = np.frombuffer(base64.b64decode(part["input_audio"]["data"]), "<i2").astype(np.float32) / 32768
    assert 1.0 < len(heard) / 16000 < 3.0 and np.sqrt(np.mean(heard**2)) > 0.01  # the microphone's speech
    # the truncation names the answer's item and no more audio than it had (2 x 0.5 s)
    truncation = s["truncations"][0]
    assert 0 <= truncation["audio_end_ms"] <= 1000
    if len(fake.calls) > 1:  # the next turn's prompt holds only what was heard of the answer
        assistant = [m for m in fake.calls[1]["messages"] if m["role"] == "assistant"]
        assert all("Hello".startswith(m["content"]) for m in assistant)


def open_demo(browser, url: str):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    page.wait_for_function("() => demoState.model === 'Qwen/Qwen3-Omni-30B-A3B-Instruct'")
    return page, errors


def test_talk_shows_a_failed_answer_and_goes_on(browser, server, fake):  # noqa: F811
    """A turn the backend fails is shown as an error in the log and the status line; the next turn clears it."""
    fake.reset()
    fake.script = Script(steps=[Step("Hel", audio=tone(2400))], error=StageUnavailableError("the talker is restarting"))
    page, errors = open_demo(browser, server.url)
    try:
        page.click("#talk")
        page.wait_for_function("() => talkState.responses > 0", timeout=30_000)
        s = talk_state(page)
        assert s["status"] == "listening" and s["error"] == "the talker is restarting"
        assert page.locator("#status").inner_text() == "talk: the talker is restarting"
        assert page.locator(".message.assistant.error").first.inner_text() == "Hel\n[the talker is restarting]"
        fake.script = Script(steps=[Step("Fine", audio=tone(2400))])
        page.wait_for_function("() => talkState.transcript === 'Fine'", timeout=30_000)
        assert talk_state(page)["error"] is None
        assert "restarting" not in page.locator("#status").inner_text()
        page.click("#talk")
        page.wait_for_function("() => talkState.status === 'off'")
        assert page.locator("#status").inner_text() == ""  # no "listening…" left behind
    finally:
        page.close()
    assert not errors, errors


def test_talk_reports_refused_and_dropped_sessions(browser, fake):  # noqa: F811
    """A session the server refuses (its session limit) or drops (it stopped) ends Talk with a message that
    says so; a refusal that comes while the page is still starting the microphone never turns into 'listening'."""
    fake.reset()
    fake.script = Script(steps=[Step("Hi", audio=tone(2400))])
    app = create_app(fake)
    app.state.realtime_limits = RealtimeLimits(max_sessions=1)
    pages = []
    try:
        with ThreadedUvicorn(app) as srv:
            first, first_errors = open_demo(browser, srv.url)
            pages.append(first)
            first.click("#talk")
            first.wait_for_function("() => talkState.status === 'listening'")
            second, second_errors = open_demo(browser, srv.url)
            pages.append(second)
            second.click("#talk")
            second.wait_for_function("() => talkState.status === 'error'")
            second.wait_for_timeout(1500)  # the microphone's start resolves after the refusal
            s = talk_state(second)
            assert s["status"] == "error" and "limit of 1 realtime sessions" in s["error"]
            assert "limit of 1 realtime sessions" in second.locator("#status").inner_text()
            assert second.locator("#talk").inner_text() == "Talk"
        # the server is gone: the open session ends with a message, and a new one says why it cannot start
        first.wait_for_function("() => talkState.status === 'error'")
        assert talk_state(first)["error"].startswith("the server closed the conversation")
        assert first.locator("#status").inner_text().startswith("talk: the server closed the conversation")
        first.click("#talk")
        first.wait_for_function("() => talkState.error?.startsWith('cannot open /v1/realtime')")
        assert "the server is down or refused the API key" in first.locator("#status").inner_text()
        assert first.locator("#talk").inner_text() == "Talk"
    finally:
        for page in pages:
            page.close()
    assert not first_errors and not second_errors, first_errors + second_errors
