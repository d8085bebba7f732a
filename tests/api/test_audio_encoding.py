import numpy as np
import pytest

from openai_frontend.audio_encoding import encode_audio, to_pcm16, to_wav, wav_header

from .fake_omni import tone
from .wav_check import parse_wav


def test_pcm16_scales_clips_and_rounds():
    x = np.array([0.0, 1.0, -1.0, 2.0, -3.0, 0.5, np.nan, 1e-6], dtype=np.float32)
    got = np.frombuffer(to_pcm16(x), dtype="<i2")
    assert got.tolist() == [0, 32767, -32767, 32767, -32767, 16384, 0, 0]


def test_pcm16_of_chunks_equals_pcm16_of_concatenation():
    x = tone(10_000)
    parts = np.array_split(x, [1, 777, 4000])
    assert b"".join(to_pcm16(p) for p in parts) == to_pcm16(x)


def test_pcm16_empty():
    assert to_pcm16(None) == b"" and to_pcm16(np.zeros(0, np.float32)) == b""


@pytest.mark.parametrize("n", [0, 1, 24000, 36_001])
def test_wav_header_and_duration(n):
    x = tone(n)
    wav = to_wav(to_pcm16(x))
    assert len(wav) == 44 + 2 * n
    samples = parse_wav(wav)
    assert len(samples) == n  # duration = n / 24000 s
    assert samples.tobytes() == to_pcm16(x)


def test_encode_audio_formats():
    pcm = to_pcm16(tone(100))
    assert encode_audio(pcm, "pcm") == pcm
    assert encode_audio(pcm, "wav") == wav_header(len(pcm)) + pcm
    with pytest.raises(ValueError):
        encode_audio(pcm, "mp3")
