# Session audio and turn detection without a server: G.711 against the ITU-T reference values, the
# resampled input's length and content, and the detector's turns on speech-like sound, noise and silence.
import numpy as np
import pytest

from openai_frontend.realtime.audio import InputAudio, OutputAudio, g711_decode, g711_encode
from openai_frontend.realtime.vad import TurnDetector
from perf.realtime_load import speech_like


@pytest.mark.parametrize("fmt, codes, values", [
    ("audio/pcmu", [0xFF, 0x80, 0x00, 0xF0, 0x70], [0, 32124, -32124, 120, -120]),
    ("audio/pcma", [0xD5, 0x55, 0xAA, 0x2A, 0xC5, 0x45], [8, -8, 32256, -32256, 264, -264]),
])  # fmt: skip
def test_g711_reference_values(fmt, codes, values):
    np.testing.assert_array_equal(g711_decode(bytes(codes), fmt), values)
    assert g711_encode(np.array(values, np.int16), fmt) == bytes(codes)  # decoded values encode back


@pytest.mark.parametrize("fmt", ["audio/pcmu", "audio/pcma"])
def test_g711_round_trip_keeps_within_one_step(fmt):
    x = np.arange(-32768, 32768, 3).astype(np.int16)
    y = g711_decode(g711_encode(x, fmt), fmt).astype(np.int32)
    step = np.maximum(np.abs(x.astype(np.int32)) // 16, 32)  # 4 mantissa bits per segment
    assert np.all(np.abs(y - x) <= step)


def test_input_is_resampled_to_16k_across_appends():
    t = np.arange(24000) / 24000
    pcm = np.rint(0.5 * 32767 * np.sin(2 * np.pi * 300 * t)).astype("<i2").tobytes()
    audio = InputAudio("audio/pcm")
    pieces = [audio.feed(pcm[i:i + 4801]) for i in range(0, len(pcm), 4801)]  # odd sizes split samples
    out = np.concatenate([*pieces, audio.flush()])
    assert len(out) == 16000
    reference = 0.5 * np.sin(2 * np.pi * 300 * np.arange(16000) / 16000)
    assert np.max(np.abs(out[200:-200] - reference[200:-200])) < 0.01


def test_output_in_g711_is_8k():
    out = OutputAudio("audio/pcmu")
    data = out.encode(np.zeros(12000, np.float32)) + out.encode(np.zeros(12000, np.float32), last=True)
    assert len(data) == 8000 and out.bytes_to_ms(len(data)) == 1000


def feed_all(detector: TurnDetector, samples: np.ndarray, step: int = 1600) -> list:
    events = []
    for i in range(0, len(samples), step):
        events += detector.feed(samples[i:i + step])
    return [(e.kind, e.audio_ms) for e in events]


def test_turns_on_speech_like_sound():
    quiet = lambda s: np.zeros(int(s * 16000), np.float32)  # noqa: E731
    audio = np.concatenate([quiet(0.5), speech_like(1.5, 16000), quiet(1.0), speech_like(1.0, 16000, f0=200), quiet(1.0)])
    events = feed_all(TurnDetector(prefix_padding_ms=300, silence_duration_ms=500), audio)
    assert [kind for kind, _ in events] == ["speech_started", "speech_stopped"] * 2
    (_, start1), (_, stop1), (_, start2), (_, stop2) = events
    assert 100 <= start1 <= 300  # speech at 500 ms, less the prefix padding
    assert 2500 <= stop1 <= 2700  # speech ends at 2000 ms; silence_duration_ms later the turn ends
    assert 2600 <= start2 <= 2800 and 4500 <= stop2 <= 4700  # speech from 3000 ms to 4000 ms


def test_noise_and_silence_are_no_turn():
    rng = np.random.default_rng(0)
    assert feed_all(TurnDetector(), (0.003 * rng.standard_normal(48000)).astype(np.float32)) == []
    assert feed_all(TurnDetector(), np.zeros(48000, np.float32)) == []
    # a high threshold needs louder speech than a low one
    soft = 0.02 * speech_like(1.0, 16000) / 0.3
    assert feed_all(TurnDetector(threshold=0.9), soft) == []
    assert feed_all(TurnDetector(threshold=0.2), soft)[0][0] == "speech_started"
