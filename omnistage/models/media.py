# Decoding of request media (base64 / data: URLs) into what the processor takes: PIL images and
# 16 kHz mono float32 waveforms. Every failure is the client's, so it is a BadRequestError.
import base64
import binascii
import io
import wave
from dataclasses import dataclass, fields
from typing import Any, Callable

import numpy as np

from omnistage.core.errors import BadRequestError
from omnistage.models.media_budget import MediaBudget

SAMPLE_RATE = 16000  # the Whisper feature extractor's rate
MIN_AUDIO_SAMPLES = 400  # one n_fft window; shorter clips yield no audio-encoder frames


@dataclass(frozen=True)
class MediaLimits:
    """What one request may carry; checked before anything is decoded in full, so a request over a limit
    costs no memory. omni_ensemble takes them from its config parameters (same names)."""

    max_audio_seconds: float = 600.0  # per clip
    max_image_pixels: int = 50_000_000  # per image, as its header declares (the processor then resizes)
    max_media_items: int = 32  # images + audio clips + videos per request
    max_video_seconds: float = 600.0  # per video, as its headers declare
    max_video_frames: int = 768  # frames sampled from one video (2 per second; Qwen's own cap is 768)
    max_video_frame_pixels: int = 8_294_400  # per frame as declared (3840x2160); frames are then resized
    max_video_bytes: int = 64 << 20  # encoded size of one video
    # decoded media (RGB bytes of images, float32 16 kHz samples of clips) of all requests being preprocessed
    # at once in this process, counted from headers; past it a request gets a 503 (media_budget.py)
    max_media_bytes_in_flight: int = 4 << 30
    max_prompt_tokens: int = 1 << 20  # the thinker's context: text that cannot fit is refused untokenized

    @classmethod
    def from_parameters(cls, params: dict) -> "MediaLimits":
        defaults = cls()
        return cls(**{f.name: type(getattr(defaults, f.name))(params[f.name]) for f in fields(cls) if f.name in params})


LIMITS = MediaLimits()  # set once per process by omni_ensemble (configure())
BUDGET = MediaBudget(LIMITS.max_media_bytes_in_flight)


def configure(limits: MediaLimits) -> None:
    global LIMITS, BUDGET
    LIMITS, BUDGET = limits, MediaBudget(limits.max_media_bytes_in_flight)


@dataclass
class PendingMedia:
    """A media item whose header was read and checked: `cost` bytes once decoded, `decode()` does it."""

    kind: str  # "image" | "audio" | "video"
    cost: int
    decode: Callable[[], Any]
    fps: float | None = None  # a video's sampled frames per second


_WAV_MIMES = {"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"}
_PCM_MIMES = {"audio/pcm", "audio/l16", "audio/pcm16"}


def b64decode(data, what: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise BadRequestError(f"{what}: expected a non-empty base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequestError(f"{what}: invalid base64 ({e})") from None


def split_data_url(url, what: str) -> tuple[str, bytes]:
    # Only inline data: the serving hosts have no outbound network, so remote URLs cannot be fetched.
    if not isinstance(url, str) or not url.startswith("data:"):
        raise BadRequestError(f"{what}: only base64 data: URLs are supported")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise BadRequestError(f"{what}: expected 'data:<mime>;base64,<data>'")
    return header[: -len(";base64")].split(";")[0].strip().lower(), b64decode(payload, what)


def open_image(raw: bytes, what: str) -> PendingMedia:
    """Reads the image's header only; decode() gives the RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    errors = (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError)
    try:
        image = Image.open(io.BytesIO(raw))  # reads the header only
        width, height = image.size
    except UnidentifiedImageError:  # its message is the repr of our BytesIO, which tells the client nothing
        raise BadRequestError(f"{what}: cannot decode image (not an image format this server reads)") from None
    except errors as e:
        raise BadRequestError(f"{what}: cannot decode image ({e})") from None
    if width * height > LIMITS.max_image_pixels:
        raise BadRequestError(f"{what}: image of {width}x{height} pixels is over the limit of "
                              f"{LIMITS.max_image_pixels} pixels")  # fmt: skip

    def decode():
        try:
            image.load()
            return image.convert("RGB")
        except errors as e:
            raise BadRequestError(f"{what}: cannot decode image ({e})") from None

    return PendingMedia("image", 3 * width * height, decode)


def decode_image(raw: bytes, what: str):
    return open_image(raw, what).decode()


def audio_format_from_mime(mime: str, what: str) -> str:
    if mime in _WAV_MIMES:
        return "wav"
    if mime in _PCM_MIMES:
        return "pcm"
    raise BadRequestError(f"{what}: unsupported audio type {mime!r} (supported: WAV, 16 kHz s16le PCM)")


def open_audio(raw: bytes, fmt: str, what: str) -> PendingMedia:
    """Reads the clip's header only (its duration checked); decode() gives 16 kHz mono float32 samples."""
    fmt = fmt.lower() if isinstance(fmt, str) else fmt
    if fmt == "wav":
        frames, rate = _wav_header(raw, what)
    elif fmt in ("pcm", "pcm16"):
        if len(raw) % 2:
            raise BadRequestError(f"{what}: s16le PCM needs an even number of bytes")
        frames, rate = len(raw) // 2, SAMPLE_RATE
    else:
        raise BadRequestError(f"{what}: unsupported audio format {fmt!r} (supported: wav, pcm)")
    _check_duration(frames, rate, what)
    return PendingMedia("audio", 4 * int(frames * SAMPLE_RATE / rate) + len(raw), lambda: _decode_audio(raw, fmt, what))


def decode_audio(raw: bytes, fmt: str, what: str) -> np.ndarray:
    return open_audio(raw, fmt, what).decode()


def _decode_audio(raw: bytes, fmt: str, what: str) -> np.ndarray:
    if fmt == "wav":
        samples, rate = _read_wav(raw, what)
    else:
        samples, rate = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0, SAMPLE_RATE
    samples = _resample(samples, rate)
    if samples.size < MIN_AUDIO_SAMPLES:
        raise BadRequestError(f"{what}: audio too short ({samples.size} samples at {SAMPLE_RATE} Hz)")
    return samples


def _wav_header(raw: bytes, what: str) -> tuple[int, int]:
    try:
        with wave.open(io.BytesIO(raw)) as w:
            frames, rate, channels = w.getnframes(), w.getframerate(), w.getnchannels()
    except (wave.Error, EOFError) as e:
        # The stdlib reader handles integer PCM only (no float or compressed WAV).
        raise BadRequestError(f"{what}: cannot read WAV ({e}); send integer PCM WAV") from None
    if rate <= 0 or channels <= 0:
        raise BadRequestError(f"{what}: invalid WAV header")
    return frames, rate


def _read_wav(raw: bytes, what: str) -> tuple[np.ndarray, int]:
    # the header was read and checked by open_audio: only what it declares is read (readframes stops there)
    with wave.open(io.BytesIO(raw)) as w:
        channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
        frames = w.readframes(w.getnframes())
    if width == 1:  # 8-bit WAV is unsigned
        x = (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(frames[: len(frames) // 3 * 3], dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = np.frombuffer(frames, dtype="<i4").astype(np.float32) / float(1 << 31)
    else:
        raise BadRequestError(f"{what}: unsupported WAV sample width {width}")
    x = x[: x.size // channels * channels].reshape(-1, channels).mean(axis=1)  # downmix to mono
    return x, rate


def _check_duration(frames: int, rate: int, what: str) -> None:
    if frames / rate > LIMITS.max_audio_seconds:
        raise BadRequestError(f"{what}: audio of {frames / rate:.0f} s is over the limit of "
                              f"{LIMITS.max_audio_seconds:.0f} s")  # fmt: skip


def _resample(x: np.ndarray, rate: int) -> np.ndarray:
    if rate == SAMPLE_RATE or x.size == 0:
        return np.ascontiguousarray(x, dtype=np.float32)
    # Linear interpolation: good enough for speech into a 128-bin log-mel front end.
    n_out = max(1, int(round(x.size * SAMPLE_RATE / rate)))
    t_out = np.arange(n_out, dtype=np.float64) * (rate / SAMPLE_RATE)
    return np.interp(t_out, np.arange(x.size, dtype=np.float64), x).astype(np.float32)
