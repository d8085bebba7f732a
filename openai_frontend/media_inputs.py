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

import httpx

from openai_frontend.audio_encoding import to_pcm16, to_wav
from openai_frontend.errors import FrontendError
from openai_frontend.settings import FrontendSettings

PASSTHROUGH_AUDIO = {"wav", "pcm", "pcm16"}  # omni_ensemble reads these itself
PASSTHROUGH_MIMES = {"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/pcm", "audio/l16", "audio/pcm16"}
TRANSCODED_AUDIO = ("mp3", "flac", "ogg", "opus", "aiff", "au")  # decoded by libsndfile


async def prepare_messages(messages: list[dict[str, Any]], settings: FrontendSettings) -> list[dict[str, Any]]:
    """The messages with every media part in a form the ensemble reads; the input is not modified."""
    fetched = await _fetch_remote(messages, settings)
    if not fetched and not any(_media_parts(messages)):
        return messages
    return await asyncio.to_thread(_normalize, messages, fetched)


def _media_parts(messages):
    """(where, kind, payload) of every image/audio part; payload is the part's inner object or string."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind in ("image_url", "audio_url", "input_audio"):
                    yield f"messages[{i}].content[{j}]", kind, part.get(kind)


def _url(payload: Any) -> Any:
    return payload.get("url") if isinstance(payload, dict) else payload


async def _fetch_remote(messages, settings: FrontendSettings) -> dict[str, tuple[str, bytes]]:
    """where -> (content type, body) of every http(s) URL, fetched concurrently."""
    remote = {where: _url(p) for where, kind, p in _media_parts(messages)
              if kind != "input_audio" and isinstance(_url(p), str) and _url(p).lower().startswith(("http://", "https://"))}  # fmt: skip
    if not remote:
        return {}
    if not settings.fetch_remote_media:
        where = next(iter(remote))
        raise FrontendError(400, f"{where}: http(s) media URLs are disabled on this server; send a base64 data: URL "
                                 "(operators: --allow-remote-media)", param=where, code="remote_media_disabled")  # fmt: skip
    limits = httpx.Timeout(settings.fetch_timeout_s)
    async with httpx.AsyncClient(timeout=limits, follow_redirects=True, max_redirects=3) as client:
        bodies = await asyncio.gather(*(_fetch(client, url, where, settings) for where, url in remote.items()))
    return dict(zip(remote, bodies))


async def _fetch(client: httpx.AsyncClient, url: str, where: str, settings: FrontendSettings) -> tuple[str, bytes]:
    try:
        async with asyncio.timeout(settings.fetch_timeout_s):  # the whole download, not only each read
            async with client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise _bad(where, f"fetching {url} gave HTTP {r.status_code}")
                body = bytearray()
                async for block in r.aiter_bytes():
                    body += block
                    if len(body) > settings.fetch_max_bytes:
                        raise _bad(where, f"{url} is larger than {settings.fetch_max_bytes} bytes")
                return r.headers.get("content-type", "").split(";")[0].strip().lower(), bytes(body)
    except (TimeoutError, httpx.TimeoutException):
        raise _bad(where, f"fetching {url} took longer than {settings.fetch_timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise _bad(where, f"cannot fetch {url}: {exc}") from None


def _normalize(messages, fetched: dict[str, tuple[str, bytes]]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = [_part(f"messages[{i}].content[{j}]", part, fetched) for j, part in enumerate(content)]
        out.append({**message, "content": parts})
    return out


def _part(where: str, part: dict[str, Any], fetched) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "input_audio":
        fmt = part["input_audio"]["format"].lower()
        raw = _b64(part["input_audio"]["data"], where)
        if fmt in PASSTHROUGH_AUDIO:
            return part
        if fmt not in TRANSCODED_AUDIO:
            supported = ", ".join([*sorted(PASSTHROUGH_AUDIO), *TRANSCODED_AUDIO])
            raise _bad(where, f"unsupported input_audio format {fmt!r}; supported: {supported}")
        return {"type": "input_audio", "input_audio": {"data": _b64str(_transcode(raw, where)), "format": "wav"}}
    if kind not in ("image_url", "audio_url"):
        return part
    if where in fetched:
        mime, raw = fetched[where]
    else:
        mime, raw = _data_url(_url(part[kind]), where)
    if kind == "audio_url" and (where in fetched or mime not in PASSTHROUGH_MIMES):
        mime, raw = "audio/wav", _transcode(raw, where)
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


def _transcode(raw: bytes, where: str) -> bytes:
    """Any audio file libsndfile reads -> 16-bit mono WAV at its own rate (the ensemble resamples)."""
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise _bad(where, f"cannot decode the audio ({exc})") from None
    return to_wav(to_pcm16(samples.mean(axis=1)), int(rate))


def _bad(where: str, message: str) -> FrontendError:
    return FrontendError(400, f"{where}: {message}", param=where)
