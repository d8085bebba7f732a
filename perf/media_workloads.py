# The media-in workloads, built deterministically (the same media and questions on every run):
#   W3 voice chat: a 5 s 16 kHz speech-like clip + a short spoken-turn instruction; 18 reply tokens, 46 frames.
#   W4 image: one 448x448 picture + a question about it; 18 reply tokens, 46 frames.
#   W5 video: a 10 s 320x240 clip with a speech-like audio track (use_audio_in_video) + a question; 18 / 46.
# The clips are synthetic voiced speech (a gliding pitch with its harmonics, formant-like weighting,
# syllables of 120-300 ms and short pauses), so a voice-activity detector and the audio encoder see
# speech-shaped input; every prompt's clip and picture differ, so no prefix or media cache can serve a
# level from one item. The lengths are forced (max_tokens + ignore_eos) as in W1.
from __future__ import annotations

import base64
import io
import random
import wave

import numpy as np

AUDIO_RATE = 16000

_SPOKEN_INSTRUCTIONS = [
    "Answer the question in the recording in one short sentence.",
    "Reply to what the speaker says, briefly.",
    "Listen to the clip and respond as a helpful assistant would.",
    "What is the speaker asking for? Answer in a few words.",
    "Give a short, friendly reply to this voice message.",
    "Respond to the speaker in one sentence.",
]
_VIDEO_QUESTIONS = [
    "What happens in this video? Answer briefly.",
    "Describe the clip and what the speaker says, in one sentence.",
    "Reply to the person in the video.",
    "What moves in this video, and what is said?",
]
_IMAGE_QUESTIONS = [
    "What shapes do you see in this picture?",
    "Describe this image in one sentence.",
    "Which colour covers most of the picture?",
    "How many objects are in this image?",
    "Is there anything round in the picture?",
    "What is in the top left corner of the image?",
]


def speech_like_clip(seconds: float, seed: int, rate: int = AUDIO_RATE) -> np.ndarray:
    """float32 mono samples in [-1, 1]: voiced syllables with gliding pitch, separated by short pauses."""
    rng = np.random.default_rng(seed)
    out = np.zeros(int(seconds * rate), dtype=np.float32)
    t = 0.15  # leading silence
    base_f0 = rng.uniform(95, 210)
    while t < seconds - 0.3:
        dur = rng.uniform(0.12, 0.30)
        n = int(dur * rate)
        start = int(t * rate)
        k = np.arange(n) / rate
        f0 = base_f0 * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(1.5, 4.0) * k + rng.uniform(0, 6.3)))
        phase = 2 * np.pi * np.cumsum(f0) / rate
        formant = rng.uniform(500, 1800)
        syllable = sum((1.0 / h) * np.exp(-(((h * base_f0) - formant) / 900.0) ** 2) * np.sin(h * phase)
                       for h in range(1, 16))  # fmt: skip
        envelope = np.sin(np.pi * np.arange(n) / n) ** 0.6
        out[start : start + n] += (0.3 * envelope * syllable).astype(np.float32)[: len(out) - start]
        t += dur + (rng.uniform(0.25, 0.45) if rng.random() < 0.2 else rng.uniform(0.02, 0.08))
    out += rng.normal(0, 0.003, out.shape).astype(np.float32)  # room noise
    return np.clip(out, -1, 1)


def wav_base64(samples: np.ndarray, rate: int = AUDIO_RATE) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def picture_png_base64(seed: int, size: int = 448) -> str:
    """A PNG of a few filled rectangles and ellipses on a coloured background, different per seed."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    colour = lambda: tuple(rng.randrange(256) for _ in range(3))  # noqa: E731
    img = Image.new("RGB", (size, size), colour())
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(3, 8)):
        x0, y0 = rng.randrange(size - 40), rng.randrange(size - 40)
        box = (x0, y0, min(size, x0 + rng.randint(30, 200)), min(size, y0 + rng.randint(30, 200)))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour())
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def voice_chat_prompts(n: int, seed: int = 0, seconds: float = 5.0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [
        [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": wav_base64(speech_like_clip(seconds, seed * 100003 + i)),
                                                    "format": "wav"}},
            {"type": "text", "text": rng.choice(_SPOKEN_INSTRUCTIONS)},
        ]}]
        for i in range(n)
    ]  # fmt: skip


def image_prompts(n: int, seed: int = 0, size: int = 448) -> list[list[dict]]:
    rng = random.Random(seed)
    return [
        [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + picture_png_base64(seed * 100003 + i, size)}},
            {"type": "text", "text": rng.choice(_IMAGE_QUESTIONS)},
        ]}]
        for i in range(n)
    ]  # fmt: skip


def video_mp4(seconds: float, seed: int, width: int = 320, height: int = 240, fps: int = 25) -> bytes:
    """An MPEG-4 clip in an mp4 container (PyAV): shapes drifting over a coloured background, every frame
    different, with a speech-like AAC audio track at 16 kHz (speech_like_clip)."""
    import av

    rng = np.random.default_rng(seed)
    background = rng.integers(0, 255, 3, dtype=np.uint8)
    shapes = [(rng.integers(10, 60), rng.integers(0, 255, 3, dtype=np.uint8), rng.uniform(-4, 4, 2)) for _ in range(4)]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        video = out.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.options = {"qscale": "4"}
        audio = out.add_stream("aac", rate=AUDIO_RATE)
        audio.layout = "mono"
        for i in range(int(seconds * fps)):
            frame = np.empty((height, width, 3), dtype=np.uint8)
            frame[:] = background
            for size, colour, (dx, dy) in shapes:
                x, y = int(width / 2 + dx * i) % width, int(height / 2 + dy * i) % height
                frame[y : y + size, x : x + size] = colour
            for packet in video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in video.encode(None):
            out.mux(packet)
        mux_audio(out, audio, speech_like_clip(seconds, seed), AUDIO_RATE)
    return buf.getvalue()


def mux_audio(out, stream, samples: np.ndarray, rate: int) -> None:
    """Encodes mono float32 samples into a PyAV audio stream of container `out`, frame by frame."""
    import av

    step = stream.codec_context.frame_size or 1024
    for start in range(0, samples.size, step):
        chunk = av.AudioFrame.from_ndarray(samples[start : start + step][None], format="flt", layout="mono")
        chunk.sample_rate, chunk.pts = rate, start
        for packet in stream.encode(chunk):
            out.mux(packet)
    for packet in stream.encode(None):
        out.mux(packet)


def video_prompts(n: int, seed: int = 0, seconds: float = 10.0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [
        [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,"
                                                       + base64.b64encode(video_mp4(seconds, seed * 100003 + i)).decode()}},
            {"type": "text", "text": rng.choice(_VIDEO_QUESTIONS)},
        ]}]
        for i in range(n)
    ]  # fmt: skip
