# Media in request messages, made ready for omni_ensemble (which only reads base64 data: URLs, WAV and
# s16le PCM): http(s) URLs fetched here when the operator allowed it (timeout, size cap); compressed
# audio (mp3, flac, ogg/opus, ...) decoded with libsndfile and re-sent as WAV; base64 checked, so a
# broken payload is a 400 naming the part before anything reaches Triton.
from __future__ import annotations

import asyncio
import base64
import binascii
import io
from typing import Any

import numpy as np

from openai_frontend import remote_media
from openai_frontend.audio_encoding import to_pcm16, to_wav
from openai_frontend.errors import FrontendError
from openai_frontend.settings import FrontendSettings

PASSTHROUGH_AUDIO = {"wav", "pcm", "pcm16"}  # omni_ensemble reads these itself
PASSTHROUGH_MIMES = {"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/pcm", "audio/l16", "audio/pcm16"}
TRANSCODED_AUDIO = ("mp3", "flac", "ogg", "opus", "aiff", "au")  # decoded by libsndfile
DECODE_BLOCK_FRAMES = 1 << 16  # frames decoded per read while counting against the duration cap
# Media that only needs its base64 checked is checked on the event loop up to this much payload (a 5 s clip is
# ~210 kB: ~0.2 ms of checking): a hop to a worker thread costs a request tens of ms of waiting for the loop and
# the GIL when many requests are in flight. Larger payloads, and any fetch or transcode, go to a thread.
INLINE_PAYLOAD_CHARS = 1 << 20


async def prepare_messages(messages: list[dict[str, Any]], settings: FrontendSettings) -> list[dict[str, Any]]:
    """The messages with every media part in a form the ensemble reads; the input is not modified."""
    fetched = await _fetch_remote(messages, settings)
    parts = list(_media_parts(messages))
    if not fetched and not parts:
        return messages
    if not fetched and _passes_through(parts):
        return _normalize(messages, fetched, settings.max_audio_seconds)
    return await asyncio.to_thread(_normalize, messages, fetched, settings.max_audio_seconds)


def _media_parts(messages):
    """(where, kind, payload) of every image/audio/video part; payload is the part's inner object or string."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind in ("image_url", "audio_url", "video_url", "input_audio"):
                    yield f"messages[{i}].content[{j}]", kind, part.get(kind)


def _passes_through(parts) -> bool:
    """Whether every media part goes to the ensemble as it is (only its base64 to check), within
    INLINE_PAYLOAD_CHARS of payload in all."""
    total = 0
    for _, kind, payload in parts:
        if kind == "input_audio":
            fmt, data = (payload.get("format"), payload.get("data")) if isinstance(payload, dict) else (None, None)
            if not isinstance(fmt, str) or fmt.lower() not in PASSTHROUGH_AUDIO:
                return False
        else:
            data = _url(payload)
            mime = data.partition(",")[0][5:].split(";")[0].strip().lower() if isinstance(data, str) else ""
            if kind == "audio_url" and mime not in PASSTHROUGH_MIMES:
                return False
        total += len(data) if isinstance(data, str) else 0
    return total <= INLINE_PAYLOAD_CHARS


def _url(payload: Any) -> Any:
    return payload.get("url") if isinstance(payload, dict) else payload


async def _fetch_remote(messages, settings: FrontendSettings) -> dict[str, tuple[str, bytes]]:
    """where -> (content type, body) of every http(s) URL, fetched concurrently (remote_media.py)."""
    remote = {where: _url(p) for where, kind, p in _media_parts(messages)
              if kind != "input_audio" and isinstance(_url(p), str) and _url(p).lower().startswith(("http://", "https://"))}  # fmt: skip
    if not remote:
        return {}
    if not settings.fetch_remote_media:
        where = next(iter(remote))
        raise FrontendError(400, f"{where}: http(s) media URLs are disabled on this server; send a base64 data: URL "
                                 "(operators: --allow-remote-media)", param=where, code="remote_media_disabled")  # fmt: skip
    allowed = remote_media.parse_networks(settings.fetch_allowed_networks)
    async with remote_media.client(settings.fetch_timeout_s) as client:
        bodies = await asyncio.gather(*(
            remote_media.fetch(client, url, where, max_bytes=settings.fetch_max_bytes,
                               timeout_s=settings.fetch_timeout_s, allowed=allowed)
            for where, url in remote.items()))  # fmt: skip
    return dict(zip(remote, bodies))


def _normalize(messages, fetched: dict[str, tuple[str, bytes]], max_seconds: float) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = [_part(f"messages[{i}].content[{j}]", part, fetched, max_seconds) for j, part in enumerate(content)]
        out.append({**message, "content": parts})
    return out


def _part(where: str, part: dict[str, Any], fetched, max_seconds: float) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "input_audio":
        fmt = part["input_audio"]["format"].lower()
        raw = _b64(part["input_audio"]["data"], where)
        if fmt in PASSTHROUGH_AUDIO:
            return part
        if fmt not in TRANSCODED_AUDIO:
            supported = ", ".join([*sorted(PASSTHROUGH_AUDIO), *TRANSCODED_AUDIO])
            raise _bad(where, f"unsupported input_audio format {fmt!r}; supported: {supported}")
        return {"type": "input_audio", "input_audio": {"data": _b64str(_transcode(raw, where, max_seconds)), "format": "wav"}}
    if kind not in ("image_url", "audio_url", "video_url"):
        return part
    if where in fetched:
        mime, raw = fetched[where]
    else:
        mime, raw = _data_url(_url(part[kind]), where)
    if kind == "audio_url" and (where in fetched or mime not in PASSTHROUGH_MIMES):
        mime, raw = "audio/wav", _transcode(raw, where, max_seconds)
    elif where not in fetched:
        return part  # a data: URL the ensemble reads as it is
    return {"type": kind, kind: {"url": f"data:{mime or 'application/octet-stream'};base64,{_b64str(raw)}"}}


def _data_url(url: Any, where: str) -> tuple[str, bytes]:
    if not isinstance(url, str) or not url.startswith("data:"):
        raise _bad(where, "expected a base64 data: URL ('data:<mime>;base64,<data>') or an http(s) URL")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise _bad(where, "expected 'data:<mime>;base64,<data>'")
    return header[: -len(";base64")].split(";")[0].strip().lower(), _b64(payload, where)


def _b64(data: str, where: str) -> bytes:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _bad(where, f"invalid base64 ({exc})") from None
    if not raw:
        raise _bad(where, "empty media payload")
    return raw


def _b64str(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _transcode(raw: bytes, where: str, max_seconds: float) -> bytes:
    """Any audio file libsndfile reads -> 16-bit mono WAV at its own rate (the ensemble resamples). Decoded
    block by block and refused once past max_seconds: a small file may hold hours (an hour of FLAC silence
    is under 1 MB), and a header's frame count may be absent or false, so the cap counts decoded frames."""
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as f:
            rate, cap = int(f.samplerate), int(max_seconds * f.samplerate)
            if rate <= 0:
                raise _bad(where, "cannot decode the audio (no sample rate)")
            if 0 < f.frames < 1 << 62 and f.frames > cap:  # a declared length over the cap: refused unread
                raise _too_long(where, f.frames / rate, max_seconds)
            blocks, frames = [], 0
            while (block := f.read(DECODE_BLOCK_FRAMES, dtype="float32", always_2d=True)).shape[0]:
                frames += block.shape[0]
                if frames > cap:
                    raise _too_long(where, frames / rate, max_seconds, at_least=True)
                blocks.append(block.mean(axis=1))  # mono as it goes: a multichannel file never sits whole
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise _bad(where, f"cannot decode the audio ({exc})") from None
    if not blocks:
        raise _bad(where, "the audio holds no samples")
    return to_wav(to_pcm16(np.concatenate(blocks)), rate)


def _too_long(where: str, seconds: float, max_seconds: float, at_least: bool = False) -> FrontendError:
    length = f"more than {max_seconds:g} s" if at_least else f"{seconds:.0f} s"
    return FrontendError(400, f"{where}: audio of {length} is over the limit of {max_seconds:g} s", param=where,
                         code="audio_too_long")  # fmt: skip


def _bad(where: str, message: str) -> FrontendError:
    return FrontendError(400, f"{where}: {message}", param=where, code="invalid_value")
