# Session audio: what a client appends (24 kHz pcm16, or 8 kHz G.711 mu-law / A-law) turned into the
# model's 16 kHz input, and the 24 kHz speech the pipeline streams turned into the session's output format.
# Resampling is soxr's streaming resampler, one per session and direction, so chunk edges leave no seams.
# G.711 is table-driven (ITU-T G.711, the same segment tables as the C reference), in numpy: Python 3.13
# has no `audioop`.
from __future__ import annotations

import numpy as np
import soxr

from omnistage.core.protocol import SAMPLE_RATE as OUTPUT_RATE

MODEL_INPUT_RATE = 16000  # the audio encoder's rate (the processor's feature extractor)
FORMAT_RATES = {"audio/pcm": 24000, "audio/pcmu": 8000, "audio/pcma": 8000}

_MULAW_BIAS, _MULAW_CLIP = 0x21, 8159  # on 14-bit magnitudes
_MULAW_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEGMENT_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _mulaw_encode_all() -> np.ndarray:
    x = np.arange(-32768, 32768, dtype=np.int32) >> 2  # 14-bit
    mask = np.where(x < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(x), _MULAW_CLIP) + _MULAW_BIAS
    segment = np.searchsorted(_MULAW_SEGMENT_ENDS, mag)
    code = (np.minimum(segment, 7) << 4) | ((mag >> (np.minimum(segment, 7) + 1)) & 0x0F)
    code = np.where(segment >= 8, 0x7F, code)
    return (code ^ mask).astype(np.uint8)


def _mulaw_decode_all() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    exponent, mantissa = (u >> 4) & 0x07, u & 0x0F
    mag = (((mantissa << 3) + 0x84) << exponent) - 0x84  # 16-bit bias
    return np.where(u & 0x80, -mag, mag).astype(np.int16)


def _alaw_encode_all() -> np.ndarray:
    x = np.arange(-32768, 32768, dtype=np.int32) >> 3  # 13-bit
    mask = np.where(x >= 0, 0xD5, 0x55)
    mag = np.where(x >= 0, x, -x - 1)
    segment = np.searchsorted(_ALAW_SEGMENT_ENDS, mag)  # first end >= mag; 8 = over the top
    step = np.where(segment < 2, 1, segment)
    code = (np.minimum(segment, 7) << 4) | ((mag >> step) & 0x0F)
    code = np.where(segment >= 8, 0x7F, code)
    return (code ^ mask).astype(np.uint8)


def _alaw_decode_all() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    t = (a & 0x0F) << 4
    segment = (a & 0x70) >> 4
    t = np.where(segment == 0, t + 8, t + 0x108)
    t = np.where(segment > 1, t << np.maximum(segment - 1, 0), t)
    return np.where(a & 0x80, t, -t).astype(np.int16)


class _Tables:
    """The four G.711 tables (64 Ki + 256 entries each way), built on first use."""

    _built: dict[str, np.ndarray] = {}

    @classmethod
    def get(cls, name: str) -> np.ndarray:
        if name not in cls._built:
            make = {"mulaw_enc": _mulaw_encode_all, "mulaw_dec": _mulaw_decode_all,
                    "alaw_enc": _alaw_encode_all, "alaw_dec": _alaw_decode_all}[name]  # fmt: skip
            cls._built[name] = make()
        return cls._built[name]


def g711_encode(pcm16: np.ndarray, fmt: str) -> bytes:
    table = _Tables.get("mulaw_enc" if fmt == "audio/pcmu" else "alaw_enc")
    return table[pcm16.astype(np.int32) + 32768].tobytes()


def g711_decode(data: bytes, fmt: str) -> np.ndarray:
    table = _Tables.get("mulaw_dec" if fmt == "audio/pcmu" else "alaw_dec")
    return table[np.frombuffer(data, dtype=np.uint8)]


def float_to_pcm16(samples: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(np.nan_to_num(samples), -1.0, 1.0) * 32767.0).astype("<i2")


class InputAudio:
    """Appended bytes in the session's input format -> float32 samples at MODEL_INPUT_RATE."""

    def __init__(self, fmt: str):
        self.format, self.rate = fmt, FORMAT_RATES[fmt]
        self._odd = b""  # a pcm16 append may end inside a sample
        self._resampler = soxr.ResampleStream(self.rate, MODEL_INPUT_RATE, 1, dtype="float32")

    def feed(self, data: bytes) -> np.ndarray:
        if self.format == "audio/pcm":
            data, self._odd = self._odd + data, b""
            if len(data) % 2:
                data, self._odd = data[:-1], data[-1:]
            pcm = np.frombuffer(data, dtype="<i2")
        else:
            pcm = g711_decode(data, self.format)
        return self._resampler.resample_chunk(pcm.astype(np.float32) / 32768.0)

    def flush(self) -> np.ndarray:
        """The samples the resampler still holds (its filter delay); the stream then starts afresh."""
        tail = self._resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        self._resampler = soxr.ResampleStream(self.rate, MODEL_INPUT_RATE, 1, dtype="float32")
        self._odd = b""
        return tail


def model_input_to_format(pcm16_16k: bytes, fmt: str) -> bytes:
    """Audio as the model hears it (16 kHz pcm16) -> bytes in a session format (what an item shows)."""
    samples = np.frombuffer(pcm16_16k, dtype="<i2").astype(np.float32) / 32768.0
    pcm = float_to_pcm16(soxr.resample(samples, MODEL_INPUT_RATE, FORMAT_RATES[fmt]))
    return pcm.tobytes() if fmt == "audio/pcm" else g711_encode(pcm, fmt)


class OutputAudio:
    """The pipeline's float32 24 kHz chunks -> bytes in the session's output format."""

    def __init__(self, fmt: str):
        self.format, self.rate = fmt, FORMAT_RATES[fmt]
        self._resampler = None if self.rate == OUTPUT_RATE else soxr.ResampleStream(OUTPUT_RATE, self.rate, 1,
                                                                                      dtype="float32")

    def encode(self, samples: np.ndarray, last: bool = False) -> bytes:
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples, last=last)
        pcm = float_to_pcm16(samples)
        return pcm.tobytes() if self.format == "audio/pcm" else g711_encode(pcm, self.format)

    def bytes_to_ms(self, nbytes: int) -> float:
        per_sample = 2 if self.format == "audio/pcm" else 1
        return 1000.0 * nbytes / per_sample / self.rate
