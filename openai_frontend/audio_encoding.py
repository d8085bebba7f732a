# Waveform encodings for responses: float32 [-1, 1] samples -> 16-bit PCM -> a file in the requested
# format. wav and pcm are a header and raw bytes; flac, mp3 and opus (in Ogg) go through libsndfile
# (the `soundfile` wheel bundles libsndfile 1.2 with FLAC, MPEG and Opus support).
from __future__ import annotations

import io
import struct

import numpy as np

from omnistage.core.protocol import SAMPLE_RATE

CHANNELS = 1
SAMPLE_WIDTH = 2  # bytes, s16le
FORMATS = ("wav", "pcm", "flac", "mp3", "opus")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg"}
# format -> (libsndfile container, subtype)
_SNDFILE = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}


def to_pcm16(samples: np.ndarray | None) -> bytes:
    """[n] float -> n little-endian int16 (clipped, rounded; NaN -> 0).

    Sample-wise, so converting chunks one by one gives the same bytes as converting their concatenation.
    """
    if samples is None or samples.size == 0:
        return b""
    x = np.nan_to_num(np.asarray(samples, dtype=np.float32).reshape(-1), nan=0.0)
    return np.rint(np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def wav_header(num_bytes: int, sample_rate: int = SAMPLE_RATE) -> bytes:
    """The 44-byte RIFF/WAVE header of a PCM s16 mono file holding `num_bytes` of samples."""
    block_align = CHANNELS * SAMPLE_WIDTH
    return (
        b"RIFF"
        + struct.pack("<I", 36 + num_bytes)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, CHANNELS, sample_rate, sample_rate * block_align, block_align, 8 * SAMPLE_WIDTH)
        + b"data"
        + struct.pack("<I", num_bytes)
    )


def to_wav(pcm16: bytes, sample_rate: int = SAMPLE_RATE) -> bytes:
    return wav_header(len(pcm16), sample_rate) + pcm16


def encode_audio(pcm16: bytes, audio_format: str, sample_rate: int = SAMPLE_RATE) -> bytes:
    """pcm16 (s16le mono) as one self-contained file in `audio_format`."""
    if audio_format == "wav":
        return to_wav(pcm16, sample_rate)
    if audio_format == "pcm":
        return pcm16
    if audio_format not in _SNDFILE:
        raise ValueError(f"unsupported audio format {audio_format!r}")
    import soundfile  # imported on use: wav/pcm-only deployments never load libsndfile

    container, subtype = _SNDFILE[audio_format]
    out = io.BytesIO()
    samples = np.frombuffer(pcm16, dtype="<i2")
    if samples.size == 0:  # libsndfile writes no valid stream for zero frames; one silent sample does
        samples = np.zeros(1, dtype="<i2")
    soundfile.write(out, samples, sample_rate, format=container, subtype=subtype)
    return out.getvalue()
