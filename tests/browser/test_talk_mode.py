# Talk mode (static/realtime.js) in headless Chromium over /v1/realtime, against the frontend over a
# scripted backend: the fake microphone loops a spoken-like utterance and a pause, so the server's VAD
# hears a turn, the answer streams and plays, and the next loop's speech barges in: playback stops, the
# server cancels the response and the page reports what was heard with conversation.item.truncate.
import base64
import io
import wave

import numpy as np
import pytest

from perf.realtime_load import speech_like

from ..api.fake_omni import Script, Step, tone
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
