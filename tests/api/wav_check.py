# Decoding helpers shared by the tests: a WAV file checked field by field, base64 pcm16 to samples.
from __future__ import annotations

import base64
import io
import struct
import wave

import numpy as np


def parse_wav(data: bytes) -> np.ndarray:
    """Checks the header of a PCM s16 mono 24 kHz WAV; returns its samples as int16."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE" and data[12:16] == b"fmt "
    assert struct.unpack("<I", data[4:8])[0] == len(data) - 8
    fmt, channels, rate, byte_rate, align, bits = struct.unpack("<HHIIHH", data[20:36])
    assert (fmt, channels, rate, byte_rate, align, bits) == (1, 1, 24000, 48000, 2, 16)
    assert data[36:40] == b"data" and struct.unpack("<I", data[40:44])[0] == len(data) - 44
    with wave.open(io.BytesIO(data)) as w:  # and the stdlib reader agrees
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        frames = w.readframes(w.getnframes())
    return np.frombuffer(frames, dtype="<i2")


def pcm16_samples(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<i2")


def expected_pcm16(samples: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(samples, -1, 1) * 32767).astype("<i2")


def decode_any(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """(int16-scaled samples, rate) of a response file in any supported format; WAV checked field by field."""
    if fmt == "wav":
        return parse_wav(data).astype(np.float32), 24000
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32), 24000
    import soundfile

    magic = {"flac": b"fLaC", "opus": b"OggS"}.get(fmt)
    assert magic is None or data.startswith(magic), data[:8]
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert samples.ndim == 1  # mono
    return samples * 32768.0, rate
