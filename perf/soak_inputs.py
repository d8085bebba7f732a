# Inputs of the soak script: the prompts of its load, and hostile requests that must each be answered 4xx
# without harming the server (also used by tests/api/test_hostile_input.py and the real-stack test).
from __future__ import annotations

import base64
import io
import json
import random
import struct
import wave
import zlib

import numpy as np

JSON = {"content-type": "application/json"}
WORDS = "the a quick brown fox jumps over lazy dog omni stage server sings loud quiet".split()


def spoken_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))


def wav_bytes(seconds: float, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (np.sin(2 * np.pi * 220 * t) * 8000).astype("<i2").tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(pcm)
    return out.getvalue()


def tiny_wav_b64() -> str:
    return base64.b64encode(wav_bytes(0.5)).decode()


def _lying_wav_header(frames: int, rate: int = 16000) -> bytes:
    """A WAV whose header declares `frames` frames but carries almost none."""
    data = b"\0" * 3200
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, rate, rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", 0xFFFFFFF0) + b"WAVE" + fmt + b"data" + struct.pack("<I", frames * 2) + data


def _png_header(width: int, height: int) -> bytes:
    """A valid PNG signature + IHDR declaring a huge image (a decompression bomb's header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def _chat(content) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2,
                       "modalities": ["text"]}).encode()  # fmt: skip


def _audio(raw: bytes, fmt: str = "wav") -> bytes:
    return _chat([{"type": "text", "text": "hi"},
                  {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": fmt}}])  # fmt: skip


def _image(raw: bytes, mime: str = "image/png") -> bytes:
    url = f"data:{mime};base64,{base64.b64encode(raw).decode()}"
    return _chat([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}])


# name -> (body factory, headers). Those in FRONTEND_ONLY are refused by the frontend itself; the rest
# reach omni_ensemble, which decodes media.
BAD_INPUTS = {
    "body over the size limit (80 MiB)": (lambda: b'{"messages": "' + b"a" * (80 << 20) + b'"}', JSON),
    "deep nesting (100k levels)": (lambda: b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON),
    "non-UTF-8 body": (lambda: b'{"messages": [{"role": "user", "content": "\xff\xfe\xfa"}]}', JSON),
    "wrong types": (lambda: json.dumps({"messages": [{"role": 7, "content": {"a": 1}}], "max_tokens": "x"}).encode(), JSON),
    "absurd max_tokens": (lambda: json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**30}).encode(), JSON),
    "absurd stage max_tokens": (lambda: json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                    "sampling_params_list": [{}, {"max_tokens": -5}]}).encode(), JSON),  # fmt: skip
    "not JSON at all": (lambda: bytes(range(256)) * 64, JSON),
    "local file as an image": (lambda: _chat([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]), JSON),
    "remote URL as audio": (lambda: _chat([{"type": "audio_url", "audio_url": {"url": "http://127.0.0.1:1/x.wav"}}]), JSON),
    "corrupt audio": (lambda: _audio(b"RIFF" + bytes(random.Random(1).randbytes(5000))), JSON),
    "corrupt image": (lambda: _image(random.Random(2).randbytes(5000)), JSON),
    "audio header declaring 10 hours": (lambda: _audio(_lying_wav_header(16000 * 36000)), JSON),
    "image header declaring 100k x 100k pixels": (lambda: _image(_png_header(100_000, 100_000)), JSON),
    "too long prompt (2M characters)": (lambda: _chat("word " * 400_000), JSON),
    "too many media items (40 clips)": (lambda: _chat([{"type": "input_audio", "input_audio": {"data": tiny_wav_b64(), "format": "wav"}}] * 40), JSON),
}
FRONTEND_ONLY = ("body over the size limit (80 MiB)", "deep nesting (100k levels)", "non-UTF-8 body", "wrong types",
                 "absurd max_tokens", "absurd stage max_tokens", "not JSON at all")  # fmt: skip
