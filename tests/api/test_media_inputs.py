# Media in messages: compressed audio re-sent as WAV (decoded only up to the duration cap), data: URLs checked,
# http(s) URLs refused unless the operator enabled fetching (then fetched with a timeout and a size cap from a
# loopback server the test allows; loopback, private, link-local and metadata addresses refused otherwise, on
# every redirect too, with errors that do not echo what the target answered).
import base64
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from openai_frontend.app import create_app
from openai_frontend.audio_encoding import encode_audio, to_pcm16
from openai_frontend.errors import FrontendError
from openai_frontend.settings import FrontendSettings

from .fake_omni import FakeOmniClient, tone
from .servers import ThreadedUvicorn
from .wav_check import parse_wav

TONE = tone(16000, freq=300)  # 2/3 s at 24 kHz
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]


def sent_part(fake, message=0, part=1) -> dict:
    return fake.calls[0]["messages"][message]["content"][part]


def wav_samples(data_b64: str) -> np.ndarray:
    return parse_wav(base64.b64decode(data_b64)).astype(np.float32) / 32768


def similar(decoded: np.ndarray, reference: np.ndarray) -> bool:
    n = min(len(decoded), len(reference)) - 2000
    best = max(np.dot(reference[:n], decoded[s:s + n]) for s in range(0, 2000, 4))
    return best / np.dot(reference[:n], reference[:n]) > 0.7


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus"])
def test_compressed_input_audio_becomes_wav(http, fake, fmt):
    encoded = encode_audio(to_pcm16(TONE), fmt)
    wire_format = "ogg" if fmt == "opus" else fmt
    r = http.post("/v1/chat/completions", json={"messages": user(
        {"type": "input_audio", "input_audio": {"data": b64(encoded), "format": wire_format}}), "modalities": ["text"]})
    assert r.status_code == 200, r.text
    part = sent_part(fake)
    assert part["type"] == "input_audio" and part["input_audio"]["format"] == "wav"
    assert similar(wav_samples(part["input_audio"]["data"]), TONE)


def test_audio_url_data_mp3_becomes_wav_and_wav_passes_through(http, fake):
    mp3 = encode_audio(to_pcm16(TONE), "mp3")
    wav = encode_audio(to_pcm16(TONE), "wav")
    parts = [{"type": "audio_url", "audio_url": {"url": f"data:audio/mpeg;base64,{b64(mp3)}"}},
             {"type": "input_audio", "input_audio": {"data": b64(wav), "format": "wav"}},
             {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(PNG)}"}}]  # fmt: skip
    assert http.post("/v1/chat/completions", json={"messages": user(*parts)}).status_code == 200
    url = sent_part(fake)["audio_url"]["url"]
    assert url.startswith("data:audio/wav;base64,") and similar(wav_samples(url.split(",", 1)[1]), TONE)
    assert fake.calls[0]["messages"][0]["content"][2:] == parts[1:]  # forwarded untouched


def test_multi_turn_with_system_keeps_order(http, fake):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                             {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(PNG)}"}}]}]  # fmt: skip
    assert http.post("/v1/chat/completions", json={"messages": messages}).status_code == 200
    assert fake.calls[0]["messages"] == messages


@pytest.mark.parametrize("parts, on_thread", [
    ([{"type": "input_audio", "input_audio": {"data": b64(encode_audio(to_pcm16(TONE), "wav")), "format": "wav"}},
      {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(PNG)}"}}], False),
    ([{"type": "input_audio", "input_audio": {"data": b64(encode_audio(to_pcm16(TONE), "flac")), "format": "flac"}}], True),
    ([{"type": "audio_url", "audio_url": {"url": f"data:audio/mpeg;base64,{b64(b'x' * 64)}"}}], True),
    ([{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(PNG * 30000)}"}}], True),
], ids=["wav and png checked inline", "flac transcoded", "mp3 url transcoded", "payload over the inline bound"])  # fmt: skip
def test_only_media_that_needs_work_goes_to_a_thread(parts, on_thread, monkeypatch):
    """A worker thread costs a request tens of ms of waiting under load: only a transcode, a fetch or a large
    payload takes one; media that only needs its base64 checked is checked on the event loop."""
    import asyncio

    from openai_frontend import media_inputs

    hops = []
    original = asyncio.to_thread

    async def counted(fn, *args):
        hops.append(fn)
        return await original(fn, *args)

    monkeypatch.setattr(media_inputs.asyncio, "to_thread", counted)
    try:
        asyncio.run(media_inputs.prepare_messages(user(*parts), FrontendSettings()))
    except FrontendError:  # the 64 bytes of "mp3" fail their transcode, on its thread all the same
        pass
    assert bool(hops) == on_thread
    assert len(b64(PNG * 30000)) > media_inputs.INLINE_PAYLOAD_CHARS


BAD = {
    "invalid base64": ({"type": "input_audio", "input_audio": {"data": "not base64!!", "format": "wav"}}, "invalid base64"),
    "unknown audio format": ({"type": "input_audio", "input_audio": {"data": b64(b"abcd"), "format": "aac"}},
                             "unsupported input_audio format"),
    "corrupt mp3": ({"type": "input_audio", "input_audio": {"data": b64(b"\x00" * 64), "format": "mp3"}},
                    "cannot decode the audio"),
    "image not a data url": ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "data: URL"),
    "data url without base64": ({"type": "audio_url", "audio_url": {"url": "data:audio/wav,RIFF"}}, "base64"),
    "http disabled": ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}, "--allow-remote-media"),
}


@pytest.mark.parametrize("part, message", BAD.values(), ids=BAD.keys())
def test_bad_media_is_a_400_naming_the_part(http, fake, part, message):
    r = http.post("/v1/chat/completions", json={"messages": user(part)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[1]" and message in error["message"]
    assert error["code"], error  # every 4xx names a code (openai_frontend/README.md, Errors)
    assert fake.calls == []


# ---- remote fetching, enabled -------------------------------------------------------------------------
class _Files(BaseHTTPRequestHandler):
    files = {"/cat.png": ("image/png", PNG), "/speech.flac": ("audio/flac", encode_audio(to_pcm16(TONE), "flac")),
             "/big.png": ("image/png", b"\x89PNG" + b"\x00" * 50_000)}  # fmt: skip

    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(2)
        if self.path.startswith("/redirect?"):
            self.send_response(302)
            self.send_header("Location", self.path.split("?", 1)[1])
            self.end_headers()
            return
        kind, body = self.files.get(self.path, (None, None))
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


@pytest.fixture(scope="module")
def files():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def fetching():
    backend = FakeOmniClient()
    settings = FrontendSettings(fetch_remote_media=True, fetch_timeout_s=0.5, fetch_max_bytes=10_000,
                                fetch_allowed_networks=("127.0.0.1/32",))  # fmt: skip
    with ThreadedUvicorn(create_app(backend, settings)) as srv:
        yield srv, backend


def test_remote_image_and_audio_are_fetched(fetching, files):
    srv, backend = fetching
    backend.reset()
    parts = [{"type": "image_url", "image_url": {"url": f"{files}/cat.png"}},
             {"type": "audio_url", "audio_url": {"url": f"{files}/speech.flac"}}]  # fmt: skip
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": user(*parts)}, timeout=10)
    assert r.status_code == 200, r.text
    image, audio = backend.calls[0]["messages"][0]["content"][1:]
    assert image["image_url"]["url"] == f"data:image/png;base64,{b64(PNG)}"
    assert audio["audio_url"]["url"].startswith("data:audio/wav;base64,")
    np.testing.assert_array_equal(wav_samples(audio["audio_url"]["url"].split(",", 1)[1]) * 32768,
                                  np.frombuffer(to_pcm16(TONE), "<i2"))  # FLAC: lossless  # fmt: skip


@pytest.mark.parametrize("path, message", [("/missing.png", "did not return a media file"),
                                           ("/big.png", "larger than 10000 bytes"),
                                           ("/slow.png", "longer than 0.5 s")])
def test_remote_fetch_failures_are_400(fetching, files, path, message):
    srv, backend = fetching
    backend.reset()
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=10,
                   json={"messages": user({"type": "image_url", "image_url": {"url": files + path}})})  # fmt: skip
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert backend.calls == []
    assert "404" not in r.json()["error"]["message"].replace(files + path, "")  # what the target answered stays here


def test_long_compressed_audio_is_refused_by_its_duration(http, fake):
    # 11 minutes of FLAC silence is a few kB; the default cap is 600 s
    flac = encode_audio(np.zeros(8000 * 660, dtype="<i2").tobytes(), "flac", sample_rate=8000)
    assert len(flac) < 200_000
    r = http.post("/v1/chat/completions", json={"messages": user(
        {"type": "input_audio", "input_audio": {"data": b64(flac), "format": "flac"}})})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "audio_too_long" and error["param"] == "messages[0].content[1]", error
    assert fake.calls == []


# ---- remote fetching, public addresses only ---------------------------------------------------------------
@pytest.fixture(scope="module")
def public_only():
    backend = FakeOmniClient()
    with ThreadedUvicorn(create_app(backend, FrontendSettings(fetch_remote_media=True, fetch_timeout_s=2))) as srv:
        yield srv, backend


FORBIDDEN = ["http://127.0.0.1:{port}/cat.png", "http://localhost:{port}/cat.png", "http://0x7f000001:{port}/cat.png",
             "http://2130706433:{port}/cat.png", "http://[::1]:{port}/cat.png", "http://[::ffff:127.0.0.1]:{port}/cat.png",
             "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/x.png", "http://192.168.1.1/x.png",
             "http://100.100.100.200/latest/meta-data/", "http://[fd00:ec2::254]/x.png", "http://0.0.0.0:{port}/cat.png"]


@pytest.mark.parametrize("url", FORBIDDEN)
def test_non_public_addresses_are_refused(public_only, files, url):
    srv, backend = public_only
    backend.reset()
    url = url.format(port=files.rsplit(":", 1)[1])
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=10,
                   json={"messages": user({"type": "image_url", "image_url": {"url": url}})})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "remote_media_forbidden" and error["param"] == "messages[0].content[1]", error
    assert backend.calls == []


def test_a_redirect_to_a_forbidden_address_is_refused(fetching, files):
    srv, backend = fetching  # loopback allowed, so the first hop is fetched; its redirect target is not
    backend.reset()
    for target in ("http://169.254.169.254/latest/meta-data/", "http://10.1.2.3/cat.png", "http://0x7f000002/cat.png"):
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=10, json={"messages": user(
            {"type": "image_url", "image_url": {"url": f"{files}/redirect?{target}"}})})
        assert r.status_code == 400 and r.json()["error"]["code"] == "remote_media_forbidden", r.text
    ok = httpx.post(f"{srv.url}/v1/chat/completions", timeout=10, json={"messages": user(
        {"type": "image_url", "image_url": {"url": f"{files}/redirect?/cat.png"}})})
    assert ok.status_code == 200, ok.text
    assert backend.calls[-1]["messages"][0]["content"][1]["image_url"]["url"] == f"data:image/png;base64,{b64(PNG)}"


# ---- video ----------------------------------------------------------------------------------------------
VIDEO_URL = "data:video/mp4;base64," + b64(b"\x00\x00\x00\x1cftypisom")  # the ensemble reads it; here only passed on


@pytest.mark.parametrize("extra, flag", [({}, None), ({"use_audio_in_video": True}, True),
                                         ({"mm_processor_kwargs": {"use_audio_in_video": True}}, True),
                                         ({"mm_processor_kwargs": {"use_audio_in_video": False}}, None)])  # fmt: skip
def test_video_parts_pass_through_with_use_audio_in_video(openai_client, fake, extra, flag):
    part = {"type": "video_url", "video_url": {"url": VIDEO_URL}}
    openai_client.chat.completions.create(model="qwen3-omni", messages=user(part), modalities=["text"], extra_body=extra)
    call = fake.calls[0]
    assert call["messages"][0]["content"][1] == part
    assert call["parameters"].get("use_audio_in_video") is flag


def test_remote_video_is_fetched_into_a_data_url(fetching, files):
    srv, backend = fetching
    backend.reset()
    _Files.files["/clip.mp4"] = ("video/mp4", b"\x00\x00\x00\x1cftypisom" + b"\x00" * 100)
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=10, json={"messages": user(
        {"type": "video_url", "video_url": {"url": f"{files}/clip.mp4"}})})
    assert r.status_code == 200, r.text
    url = backend.calls[0]["messages"][0]["content"][1]["video_url"]["url"]
    assert url == "data:video/mp4;base64," + b64(_Files.files["/clip.mp4"][1])
