# Headless Chromium (Debian's package, `make browser` installs it) driven by Playwright, with a fake
# microphone that plays MIC_TONE_HZ; the demo page is served by the real frontend on loopback.
# Each test gets a fresh page; its screenshot is kept in the test's tmp dir (and on failure reported).
from __future__ import annotations

import io
import os
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
MIC_TONE_HZ = 660.0  # what the fake microphone hears; the tests find it again in the uploaded WAV
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    # getUserMedia is granted without a prompt and reads a WAV file instead of a device
    "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
]  # fmt: skip


def tone_wav(seconds: float, freq: float, rate: int = 48000, channels: int = 1, amp: float = 0.5) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = np.rint(amp * 32767 * np.sin(2 * np.pi * freq * t)).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(pcm, channels).tobytes())
    return buf.getvalue()


def read_wav(data: bytes) -> tuple[np.ndarray, int, int]:
    """(samples as float, rate, channels) of an s16 WAV."""
    with wave.open(io.BytesIO(data)) as w:
        assert w.getsampwidth() == 2
        frames = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        return frames.astype(np.float32) / 32768.0, w.getframerate(), w.getnchannels()


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


# Module scope, not session: while sync_playwright() is open its event loop counts as running in this
# thread, and later tests calling asyncio.run() would fail.
@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium (make test does it)")
    from playwright.sync_api import sync_playwright

    mic = tmp_path_factory.mktemp("mic") / "mic.wav"
    mic.write_bytes(tone_wav(3.0, MIC_TONE_HZ))
    with sync_playwright() as pw:
        # executable_path: Debian's build, never a downloaded one
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, f"--use-file-for-fake-audio-capture={mic}"]
        )
        yield browser
        browser.close()


@pytest.fixture
def page(chromium, request, tmp_path):
    """A fresh page; JavaScript errors fail the test; a screenshot is saved when the test fails."""
    context = chromium.new_context(viewport={"width": 1100, "height": 720})
    page = context.new_page()
    page.set_default_timeout(20_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    outcome = getattr(request.node, "rep_call", None)
    if outcome is not None and outcome.failed:
        page.screenshot(path=str(tmp_path / "failure.png"))
        print(f"screenshot of the failure: {tmp_path / 'failure.png'}")
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    setattr(item, f"rep_{outcome.get_result().when}", outcome.get_result())


def save_screenshot(page, tmp_path: Path, name: str) -> Path:
    """The page as a test artifact; OMNISTAGE_UPDATE_SCREENSHOTS=1 also copies it to docs/img/."""
    path = tmp_path / name
    page.screenshot(path=str(path))
    if os.environ.get("OMNISTAGE_UPDATE_SCREENSHOTS") == "1":
        docs = Path(__file__).resolve().parents[2] / "docs" / "img"
        docs.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, docs / name)
    return path
