# The demo page in headless Chromium against the frontend over a scripted backend: what the page sends
# (voice, modalities, history, microphone / file audio as 16 kHz WAV, images, videos) is read back from the
# fake, and what it receives (text, PCM chunks) must show up in its state and be scheduled back to back.
import base64

import numpy as np
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from omnistage.core.errors import BadRequestError
from openai_frontend.app import create_app
from openai_frontend.settings import FrontendSettings

from ..api.fake_omni import FakeOmniClient, Script, Step, tone
from ..api.servers import ThreadedUvicorn
from ..oracle import png_data_url
from ..video_clips import make_video, video_data_url
from .conftest import MIC_TONE_HZ, dominant_hz, read_wav, save_screenshot, tone_wav

DONE = "() => ['done', 'error', 'stopped'].includes(demoState.status)"


@pytest.fixture(scope="module")
def fake():
    return FakeOmniClient()


@pytest.fixture(scope="module")
def server(fake):
    with ThreadedUvicorn(create_app(fake, default_voice="ethan")) as srv:
        yield srv


@pytest.fixture
def demo(page, server, fake):
    fake.reset()
    page.goto(server.url)  # / redirects to /demo/
    page.wait_for_function("() => demoState.model === 'Qwen/Qwen3-Omni-30B-A3B-Instruct'")
    return page


def state(page) -> dict:
    return page.evaluate("() => ({...demoState})")


def send(page, text: str) -> dict:
    page.fill("#prompt", text)
    page.click("#send")
    page.wait_for_function(DONE)
    return state(page)


def streaming(page, fake, text: str, step: Step) -> None:
    """Sends `text` and waits until the reply's first step has arrived; the reply then hangs (still streaming)."""
    fake.script = Script(steps=[step], hang=True)
    page.fill("#prompt", text)
    page.click("#send")
    page.wait_for_function(f"() => demoState.textReceived === {step.text!r}")


def sent_parts(fake) -> dict:
    """The last user message's content parts by type, as the backend received them."""
    return {p["type"]: p for p in fake.calls[-1]["messages"][-1]["content"]}


def uploaded_wav(part) -> tuple[np.ndarray, int, int]:
    assert part["input_audio"]["format"] == "wav"
    return read_wav(base64.b64decode(part["input_audio"]["data"]))


def test_text_and_speech_stream_into_the_page(demo, fake, tmp_path):
    chunks = [24000, 9600, 2400]  # samples at 24 kHz; each arrives well before the previous one ends
    offsets = np.cumsum([0, *chunks[:-1]])
    fake.script = Script(
        steps=[Step(t, tone(n, offset=o), delay_s=0.05) for t, n, o in zip(["Hello", " there", "!"], chunks, offsets)]
    )
    demo.select_option("#voice", "chelsie")
    s = send(demo, "Say hello")
    assert s["status"] == "done" and s["error"] is None
    assert s["textReceived"] == "Hello there!"
    assert demo.locator(".message.assistant .text").inner_text() == "Hello there!"
    assert s["audioChunks"] == 3 and s["audioSamples"] == sum(chunks)
    assert s["playbackStarted"]
    # back to back on the AudioContext clock: no gap, no overlap
    assert s["scheduledSeconds"] == pytest.approx(sum(chunks) / 24000, abs=1e-3) and s["playbackGaps"] == 0
    assert 0 < s["ttfaMs"] < 5000 and s["rtf"] > 0
    # the context clock runs through every chunk (headless Chromium renders to a fake sink)
    demo.wait_for_function("() => demoState.chunksPlayed === 3", timeout=10_000)
    assert "RTF" in demo.locator(".metrics").inner_text()

    call = fake.calls[-1]
    assert call["parameters"]["modalities"] == "text,audio" and call["parameters"]["speaker"] == "chelsie"
    assert call["messages"] == [{"role": "user", "content": "Say hello"}]
    save_screenshot(demo, tmp_path, "demo_fake.png")

    # a text-only second turn carries the first one as history
    demo.select_option("#modality", "text")
    fake.script = Script(steps=[Step("Fine.")])
    s = send(demo, "How are you?")
    assert s["textReceived"] == "Fine." and s["audioChunks"] == 0 and not s["playbackStarted"]
    call = fake.calls[-1]
    assert call["parameters"]["modalities"] == "text" and "speaker" not in call["parameters"]
    assert call["messages"] == [
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "Hello there!"},
        {"role": "user", "content": "How are you?"},
    ]


def test_microphone_recording_is_sent_as_wav(demo, fake):
    demo.click("#mic")
    demo.wait_for_function("() => demoState.status === 'recording'")
    demo.wait_for_timeout(1500)
    demo.click("#mic")  # stops and sends
    demo.wait_for_function(DONE)
    s = state(demo)
    assert s["status"] == "done" and s["lastRequest"]["parts"] == ["input_audio"]
    samples, rate, channels = uploaded_wav(sent_parts(fake)["input_audio"])
    assert (rate, channels) == (16000, 1)
    assert 1.0 < len(samples) / rate < 3.0
    assert dominant_hz(samples, rate) == pytest.approx(MIC_TONE_HZ, abs=10)  # what the fake microphone played


def test_attached_audio_file_and_image(demo, fake, tmp_path):
    wav = tmp_path / "question.wav"
    wav.write_bytes(tone_wav(0.5, 440.0, rate=44100, channels=2))
    png_url = png_data_url(seed=3)
    png = tmp_path / "picture.png"
    png.write_bytes(base64.b64decode(png_url.split(",", 1)[1]))
    demo.set_input_files("#audio-input", str(wav))
    demo.set_input_files("#image-input", str(png))
    demo.wait_for_selector("#attachments .chip[data-kind=audio]")
    demo.wait_for_selector("#attachments .chip[data-kind=image]")
    s = send(demo, "What do you hear and see?")
    assert s["status"] == "done"
    parts = sent_parts(fake)
    assert list(parts) == ["image_url", "input_audio", "text"]
    assert parts["image_url"]["image_url"]["url"] == png_url  # the file as it was, as a data: URI
    assert parts["text"]["text"] == "What do you hear and see?"
    samples, rate, channels = uploaded_wav(parts["input_audio"])
    assert (rate, channels) == (16000, 1)  # resampled from 44.1 kHz and mixed down from stereo
    assert len(samples) == pytest.approx(8000, abs=2)
    assert dominant_hz(samples, rate) == pytest.approx(440, abs=5)
    assert demo.locator("#attachments .chip").count() == 0  # sent attachments are cleared


def test_attached_video_with_and_without_its_sound(demo, fake, tmp_path):
    """A video goes as a video_url data: URI; its sound is part of the prompt (use_audio_in_video) unless
    the chip's box is unticked, and the latest video sent decides it for the rest of the conversation."""
    raw = make_video(seconds=1.0, fps=4, width=64, height=48, audio=True)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(raw)
    demo.set_input_files("#video-input", str(clip))
    demo.wait_for_selector("#attachments .chip[data-kind=video]")
    assert send(demo, "What happens?")["status"] == "done"
    parts = sent_parts(fake)
    assert list(parts) == ["video_url", "text"]
    assert parts["video_url"]["video_url"]["url"] == video_data_url(raw)  # the file as it was
    assert fake.calls[-1]["parameters"].get("use_audio_in_video") is True
    assert demo.locator(".message.user video").count() == 1
    assert send(demo, "And then?")["status"] == "done"  # a follow-up resends the video: still with its sound
    assert fake.calls[-1]["parameters"].get("use_audio_in_video") is True

    demo.click("#new-chat")
    demo.set_input_files("#video-input", str(clip))
    demo.get_by_label("clip.mp4: with its sound").uncheck()
    assert send(demo, "What do you see?")["status"] == "done"
    assert list(sent_parts(fake)) == ["video_url", "text"]
    assert "use_audio_in_video" not in fake.calls[-1]["parameters"]


def test_keyboard_alone_attaches_sends_and_stops(demo, fake, tmp_path):
    """Every control is in the tab order (the file pickers too), and Send / Stop hand the focus on."""
    focused = []
    for _ in range(14):
        demo.keyboard.press("Tab")
        focused.append(demo.evaluate("() => document.activeElement.id"))
    assert focused[:13] == ["voice", "modality", "max-tokens", "speech-frames", "api-key", "new-chat",
                            "image-input", "audio-input", "video-input", "mic", "talk", "prompt", "send"]  # fmt: skip
    png = tmp_path / "picture.png"
    png.write_bytes(base64.b64decode(png_data_url(seed=3).split(",", 1)[1]))
    chooser = None
    for _ in range(3):  # headless Chromium on a loaded host at times drops a key's activation of the picker
        demo.focus("#image-input")
        try:
            with demo.expect_file_chooser(timeout=5000) as opened:
                demo.keyboard.press("Space")
            chooser = opened.value
            break
        except PlaywrightTimeout:
            pass
    assert chooser is not None, "Space on the focused Image picker opened no file chooser"
    chooser.set_files(str(png))
    demo.wait_for_selector("#attachments .chip[data-kind=image] button[aria-label='remove picture.png']")

    fake.script = Script(steps=[Step("Thinking")], hang=True)
    demo.fill("#prompt", "Look")
    demo.focus("#send")
    demo.keyboard.press("Enter")
    demo.wait_for_function("() => demoState.textReceived === 'Thinking'")
    assert demo.evaluate("() => document.activeElement.id") == "stop"
    demo.keyboard.press("Enter")
    demo.wait_for_function(DONE)
    assert state(demo)["status"] == "stopped" and demo.evaluate("() => document.activeElement.id") == "prompt"
    assert list(sent_parts(fake)) == ["image_url", "text"]
    assert demo.get_by_label("Message").count() == 1

    # Escape stops a reply wherever the focus is
    fake.script = Script(steps=[Step("Again")], hang=True)
    demo.fill("#prompt", "Once more")
    demo.keyboard.press("Enter")
    demo.wait_for_function("() => demoState.textReceived === 'Again'")
    demo.focus("#voice")
    demo.keyboard.press("Escape")
    demo.wait_for_function(DONE)
    assert state(demo)["status"] == "stopped"

    # Enter that confirms an input method's candidate (Chinese, Japanese, ...) is not a send
    demo.fill("#prompt", "你好")
    demo.dispatch_event("#prompt", "keydown", {"key": "Enter", "isComposing": True})
    demo.wait_for_timeout(200)
    assert state(demo)["status"] == "stopped" and demo.input_value("#prompt") == "你好"


def test_phone_width(demo, fake, tmp_path):
    """At a phone's width the message box keeps a usable width and every control stays on screen."""
    demo.set_viewport_size({"width": 360, "height": 640})
    assert demo.locator("#prompt").bounding_box()["width"] > 300
    for control in ("label.button", "#mic", "#talk", "#send", "#new-chat", "#api-key"):
        for box in [el.bounding_box() for el in demo.locator(control).all()]:
            assert box["x"] >= 0 and box["x"] + box["width"] <= 360, (control, box)
    assert demo.evaluate("() => document.documentElement.scrollWidth") <= 360  # no sideways scrolling
    fake.script = Script(steps=[Step("Hi")])
    assert send(demo, "Hello from a phone")["status"] == "done"
    demo.screenshot(path=str(tmp_path / "phone.png"))


def test_server_error_is_shown_and_the_message_comes_back_for_a_retry(demo, fake, tmp_path):
    png = tmp_path / "picture.png"
    png.write_bytes(base64.b64decode(png_data_url(seed=3).split(",", 1)[1]))
    demo.set_input_files("#image-input", str(png))
    demo.wait_for_selector("#attachments .chip[data-kind=image]")
    fake.script = Script(steps=[], error=BadRequestError("messages[0]: cannot decode image"))
    s = send(demo, "hi")
    assert s["status"] == "error" and s["error"] == "400: messages[0]: cannot decode image"
    assert "cannot decode image" in demo.locator("#status").inner_text()
    assert "cannot decode image" in demo.locator(".message.assistant.error").inner_text()
    # the text and the picture are back in the composer: one click retries
    assert demo.input_value("#prompt") == "hi"
    assert demo.locator("#attachments .chip[data-kind=image]").count() == 1
    fake.script = Script(steps=[Step("Fine")])
    demo.click("#send")
    demo.wait_for_function("() => demoState.status === 'done'")
    assert list(sent_parts(fake)) == ["image_url", "text"]


def test_unreachable_server_and_cut_stream_are_named(page, fake):
    """A server that is gone, or a stream that ends without [DONE], is an error that says so."""
    fake.reset()
    with ThreadedUvicorn(create_app(fake)) as gone:
        page.goto(gone.url)
        page.wait_for_function("() => demoState.model !== null")
    s = send(page, "hi")
    assert s["status"] == "error" and s["error"].startswith("cannot reach the server at 127.0.0.1:"), s["error"]
    assert "is it running?" in page.locator("#status").inner_text()
    assert page.locator("#send").is_visible() and page.locator("#stop").is_hidden()  # no stuck reply

    # a proxy or a dying server closing the stream cleanly mid-reply: the reply is incomplete, not done
    cut = 'data: {"choices":[{"index":0,"delta":{"content":"Hal"}}]}\n\n'
    page.route("**/v1/chat/completions",
               lambda route: route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=cut))  # fmt: skip
    s = send(page, "hi")
    assert s["status"] == "error" and "without [DONE]" in s["error"] and s["textReceived"] == "Hal"
    assert s["replies"] == 0 and "without [DONE]" in page.locator(".message.assistant.error").last.inner_text()


def test_stop_cancels_the_request(demo, fake):
    streaming(demo, fake, "Talk forever", Step("Thinking", tone(2400)))
    demo.click("#stop")
    demo.wait_for_function(DONE)
    assert state(demo)["status"] == "stopped"
    assert fake.cancelled.wait(5)  # the frontend saw the disconnect and closed the backend stream


def test_new_chat_drops_the_reply_in_flight(demo, fake):
    """New chat while a reply streams: the reply stops, and the new chat's history starts empty."""
    streaming(demo, fake, "First chat", Step("Old", tone(24000)))
    demo.click("#new-chat")
    demo.wait_for_function(DONE)
    assert state(demo)["status"] == "stopped" and demo.locator("#log .message").count() == 0
    assert fake.cancelled.wait(5)
    fake.script = Script(steps=[Step("New")])
    s = send(demo, "Second chat")
    assert s["status"] == "done" and s["textReceived"] == "New"
    assert fake.calls[-1]["messages"] == [{"role": "user", "content": "Second chat"}]


def test_api_key(page, fake):
    """With --api-key the page itself stays public; its API calls carry the key the user types."""
    fake.reset()
    with ThreadedUvicorn(create_app(fake, FrontendSettings(api_key="s3cret"))) as guarded:
        page.goto(guarded.url)
        page.wait_for_function("() => demoState.status === 'error'")
        assert state(page)["error"].startswith("models: 401")
        assert "enter the API key" in page.locator("#status").inner_text()

        page.fill("#api-key", "wrong")
        page.press("#api-key", "Tab")  # change event: the page retries /v1/models
        page.wait_for_timeout(300)
        assert state(page)["model"] is None
        s = send(page, "hi")
        assert s["status"] == "error" and s["error"].startswith("401: invalid or missing API key")
        assert fake.calls == []

        page.fill("#api-key", "s3cret")
        page.press("#api-key", "Tab")
        page.wait_for_function(
            "() => demoState.model === 'Qwen/Qwen3-Omni-30B-A3B-Instruct' && demoState.status === 'idle'")
        s = send(page, "hi")
        assert s["status"] == "done" and s["textReceived"] == "Hello world" and len(fake.calls) == 1
