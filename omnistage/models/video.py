# Video parts: read with PyAV, frames sampled and sized as Qwen's own preprocessing does (qwen-omni-utils'
# fetch_video: 2 frames per second, 4..768 frames in steps of 2, evenly spaced indices; each frame resized to
# a multiple of 32 px holding 128..768 merged 32x32 patches), and, for use_audio_in_video, the clip's own audio
# track as 16 kHz mono. Everything the limits need comes from the container's headers: a video over a limit
# is a 400 before any frame is decoded, and decoding keeps only the sampled frames.
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from omnistage.core.errors import BadRequestError
from omnistage.models import media

FPS = 2.0  # frames sampled per second of video
FRAME_FACTOR = 2  # the vision encoder's temporal patch: frame counts are multiples of it
MIN_FRAMES, MAX_FRAMES = 4, 768
FACTOR = 32  # patch 16 x spatial merge 2: frame sides are multiples of it
MIN_FRAME_PIXELS, MAX_FRAME_PIXELS = 128 * FACTOR**2, 768 * FACTOR**2
TOTAL_PIXELS = 128000 * FACTOR**2 * 0.9  # qwen-omni-utils' budget over all frames of one video
MAX_RATIO = 200  # longest side over shortest
AUDIO_BLOCK = 1 << 15  # samples per resampled audio block while counting against the duration cap
# Sampled frames resized per call. qwen-omni-utils resizes a clip's uint8 frames in one call of torchvision's
# resize (bicubic, antialiased: torch's interpolate); batched, that kernel takes a fraction of PIL's time frame
# by frame (perf/results/cpu-video-resize-intake.json). Groups bound what sits decoded at the source size.
RESIZE_GROUP = 8


@dataclass(frozen=True)
class VideoPlan:
    """What a video's headers say and what will be taken from it."""

    width: int
    height: int
    total_frames: int
    fps: float  # the stream's frame rate
    indices: tuple[int, ...]  # sampled frame numbers
    size: tuple[int, int]  # (height, width) of each sampled frame after resizing
    audio_seconds: float | None  # the audio track's length; None when the clip has none

    @property
    def sample_fps(self) -> float:  # frames taken per second of video (the processor's `fps`)
        return len(self.indices) / max(self.total_frames, 1e-6) * self.fps


def _round(x: float, f: int) -> int:
    return round(x / f) * f


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise BadRequestError(f"video aspect ratio over {MAX_RATIO}")
    h, w = max(FACTOR, _round(height, FACTOR)), max(FACTOR, _round(width, FACTOR))
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / FACTOR) * FACTOR, math.floor(width / beta / FACTOR) * FACTOR
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / FACTOR) * FACTOR, math.ceil(width * beta / FACTOR) * FACTOR
    return h, w


def sample_count(total_frames: int, fps: float) -> int:
    """qwen-omni-utils' smart_nframes with its defaults."""
    lo = math.ceil(MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
    hi = math.floor(min(MAX_FRAMES, total_frames) / FRAME_FACTOR) * FRAME_FACTOR
    n = min(min(max(total_frames / fps * FPS, lo), hi), total_frames)
    return math.floor(n / FRAME_FACTOR) * FRAME_FACTOR


def plan(raw: bytes, what: str, with_audio: bool) -> VideoPlan:
    """Reads the container's headers and checks them against the limits; decodes nothing."""
    limits = media.LIMITS
    if len(raw) > limits.max_video_bytes:
        raise BadRequestError(f"{what}: video of {len(raw)} bytes is over the limit of {limits.max_video_bytes}")
    with _open(raw, what) as container:
        if not container.streams.video:
            raise BadRequestError(f"{what}: the file holds no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        seconds = _seconds(stream, container)
        total = stream.frames or int(round(seconds * rate))
        audio = container.streams.audio[0] if container.streams.audio else None
        audio_seconds = _seconds(audio, container) if audio is not None else None
    if width <= 0 or height <= 0 or rate <= 0 or total <= 0:
        raise BadRequestError(f"{what}: the video's headers give no size, frame rate or length")
    if width * height > limits.max_video_frame_pixels:
        raise BadRequestError(f"{what}: video frames of {width}x{height} pixels are over the limit of "
                              f"{limits.max_video_frame_pixels} pixels")  # fmt: skip
    if total / rate > limits.max_video_seconds:
        raise BadRequestError(f"{what}: video of {total / rate:.0f} s is over the limit of "
                              f"{limits.max_video_seconds:g} s")  # fmt: skip
    n = sample_count(total, rate)
    if n < FRAME_FACTOR:
        raise BadRequestError(f"{what}: video too short ({total} frames)")
    if n > limits.max_video_frames:
        raise BadRequestError(f"{what}: video would give {n} frames, over the limit of {limits.max_video_frames}")
    if with_audio and audio_seconds is None:
        raise BadRequestError(f"{what}: use_audio_in_video needs a video with an audio track")
    if with_audio and audio_seconds > limits.max_audio_seconds:
        raise BadRequestError(f"{what}: the video's audio of {audio_seconds:.0f} s is over the limit of "
                              f"{limits.max_audio_seconds:g} s")  # fmt: skip
    max_pixels = max(min(MAX_FRAME_PIXELS, TOTAL_PIXELS / n * FRAME_FACTOR), int(MIN_FRAME_PIXELS * 1.05))
    try:
        size = smart_resize(height, width, MIN_FRAME_PIXELS, max_pixels)
    except BadRequestError as e:
        raise BadRequestError(f"{what}: {e}") from None
    indices = tuple(int(i) for i in np.linspace(0, total - 1, n).round())
    return VideoPlan(width, height, total, rate, indices, size, audio_seconds if with_audio else None)


def cost(p: VideoPlan) -> int:
    """Bytes held once decoded: the sampled frames (RGB), a group of full frames being resized (and its stacked
    copy) beside the decoder's frame, the audio (float32)."""
    frames = len(p.indices) * p.size[0] * p.size[1] * 3 + (2 * RESIZE_GROUP + 1) * p.width * p.height * 3
    return frames + (4 * int(p.audio_seconds * media.SAMPLE_RATE) if p.audio_seconds else 0)


def decode_frames(raw: bytes, p: VideoPlan, what: str) -> np.ndarray:
    """The sampled frames, resized (bicubic, antialiased), [T, H, W, 3] uint8. A stream with fewer frames than
    its header declares repeats its last frame, as qwen-omni-utils pads to whole temporal patches."""
    wanted, frames, group = set(p.indices), {}, []
    with _open(raw, what) as container:
        try:
            for number, frame in enumerate(container.decode(video=0)):
                if number > p.indices[-1]:
                    break
                if number in wanted:
                    group.append((number, frame.to_ndarray(format="rgb24")))
                    if len(group) == RESIZE_GROUP:
                        frames.update(_resized(group, p.size))
                        group = []
        except Exception as e:  # PyAV's decode errors (av.error.*) come in many classes
            raise BadRequestError(f"{what}: cannot decode the video ({e})") from None
    frames.update(_resized(group, p.size))
    if not frames:
        raise BadRequestError(f"{what}: the video holds no decodable frame")
    out, last = [], frames[min(frames)]
    for i in p.indices:
        last = frames.get(i, last)
        out.append(last)
    return np.stack(out)


def _resized(group: list[tuple[int, np.ndarray]], size: tuple[int, int]) -> dict[int, np.ndarray]:
    """frame number -> the frame at `size`, by torch's uint8 bicubic with antialiasing (torchvision's resize)."""
    if not group:
        return {}
    import torch

    batch = torch.from_numpy(np.stack([rgb for _, rgb in group])).permute(0, 3, 1, 2)
    out = torch.nn.functional.interpolate(batch, size=size, mode="bicubic", antialias=True).permute(0, 2, 3, 1)
    return {number: frame.numpy() for (number, _), frame in zip(group, out)}


def decode_audio(raw: bytes, what: str) -> np.ndarray:
    """The first audio track as 16 kHz mono float32, decoded a block at a time and refused once longer than
    max_audio_seconds (a header's duration may be absent or false)."""
    import av

    cap = int(media.LIMITS.max_audio_seconds * media.SAMPLE_RATE)
    blocks, total = [], 0
    resampler = av.AudioResampler(format="flt", layout="mono", rate=media.SAMPLE_RATE)
    with _open(raw, what) as container:
        try:
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    block = out.to_ndarray().reshape(-1)
                    total += block.size
                    if total > cap:
                        raise BadRequestError(f"{what}: the video's audio is over the limit of "
                                              f"{media.LIMITS.max_audio_seconds:g} s")  # fmt: skip
                    blocks.append(block.copy())
            blocks += [out.to_ndarray().reshape(-1).copy() for out in resampler.resample(None)]
        except BadRequestError:
            raise
        except Exception as e:
            raise BadRequestError(f"{what}: cannot decode the video's audio ({e})") from None
    samples = np.concatenate(blocks) if blocks else np.zeros(0, np.float32)
    if samples.size < media.MIN_AUDIO_SAMPLES:
        raise BadRequestError(f"{what}: the video's audio is too short ({samples.size} samples)")
    return samples.astype(np.float32, copy=False)


def _seconds(stream, container) -> float:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    return float(container.duration or 0) / 1e6  # av.time_base: microseconds


def _open(raw: bytes, what: str):
    import av

    try:
        return av.open(io.BytesIO(raw), mode="r")
    except Exception as e:
        raise BadRequestError(f"{what}: cannot read the video ({e})") from None
