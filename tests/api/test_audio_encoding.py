import io

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
        encode_audio(pcm, "aac")


@pytest.mark.parametrize("fmt, magic, exact", [("flac", b"fLaC", True), ("mp3", None, False), ("opus", b"OggS", False)])
def test_encode_compressed_formats(fmt, magic, exact):
    import soundfile

    x = tone(24000, amp=0.5)  # 1 s
    data = encode_audio(to_pcm16(x), fmt)
    if magic:
        assert data.startswith(magic)
    else:  # an MPEG frame sync or an ID3 tag
        assert data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)
    decoded, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000 and decoded.ndim == 1
    assert abs(len(decoded) - 24000) <= (0 if exact else 2400)  # lossy codecs may pad by a frame
    if exact:  # FLAC is lossless: the very pcm16 samples
        np.testing.assert_array_equal(np.rint(decoded * 32768).astype(np.int16), np.frombuffer(to_pcm16(x), "<i2"))
    else:  # lossy, but the same tone: strong correlation at the best alignment
        ref = x[:20000]
        best = max(np.dot(ref, decoded[s:s + 20000]) for s in range(0, len(decoded) - 20000, 8))
        assert best / np.dot(ref, ref) > 0.7


def test_encode_empty_audio_is_a_valid_file():
    import soundfile

    for fmt in ("flac", "mp3", "opus"):
        assert soundfile.info(io.BytesIO(encode_audio(b"", fmt))).samplerate == 24000
