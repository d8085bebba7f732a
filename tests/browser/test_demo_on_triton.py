# The demo page against the real pipeline (tiny checkpoint, real tritonserver, `python -m openai_frontend`)
# in headless Chromium: a typed question and a spoken one about an image (fake microphone) each get
# streamed text and speech that starts playing; the screenshot is the README's.
import base64

import pytest

from omnistage.launch.render import default_spec
from omnistage.launch.triton_env import REPO_ROOT

from ..api.servers import FrontendProcess
from ..oracle import png_data_url
from ..triton.conftest import RepoSpec, triton_server  # noqa: F401  (fixture)
from .conftest import save_screenshot

REPLY, FRAMES = 5, 30  # text tokens, codec frames: a short answer on 2 CPU cores
SAMPLES_PER_FRAME, DECODER_TAIL = 1920, 555  # 24 kHz samples per codec frame; what the streamed decode holds back
DONE = "() => ['done', 'error', 'stopped'].includes(demoState.status)"


@pytest.fixture(scope="module")
def repo_spec(tiny_checkpoint):
    return RepoSpec(models=default_spec(str(tiny_checkpoint), "cpu"), src=REPO_ROOT / "model_repository")


@pytest.fixture(scope="module")
def frontend(triton_server):  # noqa: F811
    with FrontendProcess("--triton-url", triton_server.grpc_url) as f:
        yield f


def finished(page) -> dict:
    page.wait_for_function(DONE, timeout=120_000)
    return page.evaluate("() => ({...demoState})")


def assert_spoken_reply(s: dict) -> None:
    assert s["status"] == "done", s["error"]
    assert s["textReceived"] and s["finishReason"] == "length"
    assert s["usage"]["completion_tokens"] == REPLY
    frames = s["usage"]["completion_tokens_details"]["audio_tokens"]
    assert 0 < frames <= FRAMES
    assert s["audioChunks"] >= 1 and s["audioSamples"] == frames * SAMPLES_PER_FRAME - DECODER_TAIL
    assert s["playbackStarted"]
    # slower than real time on 2 CPU cores: later chunks may start after a gap, never overlap
    assert s["scheduledSeconds"] >= s["audioSeconds"] - 1e-3
    assert (s["playbackGaps"] > 0) == (s["scheduledSeconds"] > s["audioSeconds"] + 1e-3)
    assert s["ttfaMs"] > 0 and s["rtf"] > 0


def test_talk_to_the_tiny_model(page, frontend, tmp_path):
    page.goto(f"{frontend.url}/")
    page.wait_for_function("() => demoState.model === 'Qwen/Qwen3-Omni-30B-A3B-Instruct'")
    page.select_option("#voice", "aiden")
    page.fill("#max-tokens", str(REPLY))
    page.fill("#speech-frames", str(FRAMES))

    page.fill("#prompt", "Say hello!")
    page.press("#prompt", "Enter")
    first = finished(page)
    assert_spoken_reply(first)
    assert first["lastRequest"] == {"modalities": ["text", "audio"], "voice": "aiden", "parts": ["text"], "inputAudioSeconds": None}
    page.wait_for_function("n => demoState.chunksPlayed === n", arg=first["audioChunks"], timeout=30_000)

    image = tmp_path / "picture.png"
    image.write_bytes(base64.b64decode(png_data_url(seed=1, size=96).split(",", 1)[1]))
    page.set_input_files("#image-input", str(image))
    page.wait_for_selector("#attachments .chip[data-kind=image]")
    page.click("#mic")
    page.wait_for_function("() => demoState.status === 'recording'")
    page.wait_for_timeout(1500)
    page.click("#mic")  # stops recording and sends the clip as input_audio, with the image
    second = finished(page)
    assert_spoken_reply(second)
    assert second["lastRequest"]["parts"] == ["image_url", "input_audio"]
    assert second["lastRequest"]["inputAudioSeconds"] > 1
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + 25  # history, image and audio tokens
    assert second["replies"] == 2
    page.wait_for_timeout(500)  # let the metrics line catch up with playback
    print(f"screenshot: {save_screenshot(page, tmp_path, 'demo.png')}")
    print(f"first reply: TTFA {first['ttfaMs']:.0f} ms, RTF {first['rtf']:.2f}; "
          f"spoken question: TTFA {second['ttfaMs']:.0f} ms, RTF {second['rtf']:.2f}")  # fmt: skip
