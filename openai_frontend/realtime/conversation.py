# A session's conversation: its items in order (user audio and text, assistant transcript or text,
# system text, function calls and their outputs), what events show of them, and the `omni_ensemble`
# messages they make as a prompt (tool_calls.py renders the tools and calls as the chat path does).
# User audio is kept as the model hears it (16 kHz pcm16); an assistant item keeps its transcript piece
# by piece with the token count at each piece, so a truncation at audio_end_ms keeps the text that was
# spoken by then (the talker speaks one reply token per codec frame).
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from openai_frontend.realtime.audio import InputAudio, model_input_to_format
from openai_frontend.realtime.events import EventError, field as get, new_id
from openai_frontend.tool_calls import prompt_messages

FRAME_MS = 80  # one codec frame (12.5 Hz): the talker's time for one reply token
ITEM_BYTES = 1024  # what an item holds besides its content (its objects and id), for the conversation's size


@dataclass
class Item:
    role: str  # user | assistant | system
    id: str = field(default_factory=lambda: new_id("item"))
    status: str = "completed"
    texts: list[str] = field(default_factory=list)  # user / system text parts
    audios: list[bytes] = field(default_factory=list)  # user: each input_audio part as 16 kHz pcm16
    images: list[str] = field(default_factory=list)  # user: image URLs (data:)
    pieces: list[tuple[int, str]] = field(default_factory=list)  # assistant: (reply tokens so far, text)
    audio_out: bool = False  # assistant: spoken (output_audio + transcript) rather than output_text
    audio_ms: float = 0.0  # assistant: audio produced
    order: list[str] = field(default_factory=list)  # user content part kinds in the client's order

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.pieces)

    @property
    def nbytes(self) -> int:
        """About what the item holds in memory: its text, image URLs and audio, and ITEM_BYTES."""
        return (ITEM_BYTES + sum(map(len, self.texts)) + sum(map(len, self.images)) + sum(map(len, self.audios))
                + sum(len(t) for _, t in self.pieces))  # fmt: skip

    def public(self, audio_format: str | None = None) -> dict[str, Any]:
        """The item as events show it; with `audio_format` (conversation.item.retrieved), user audio too, as
        the model hears it (after turn detection cut it) in that format."""
        if self.role == "assistant":
            kind = {"type": "output_audio", "transcript": self.text} if self.audio_out else \
                   {"type": "output_text", "text": self.text}  # fmt: skip
            content = [kind] if self.status != "in_progress" else []  # parts come with content_part.added
        else:
            texts, images, audios = iter(self.texts), iter(self.images), iter(self.audios)
            content = []
            for kind in self.order:
                if kind == "input_text":
                    content.append({"type": "input_text", "text": next(texts)})
                elif kind == "input_image":
                    content.append({"type": "input_image", "image_url": next(images)})
                else:  # there is no input transcription
                    content.append({"type": "input_audio", "transcript": None})
                    pcm = next(audios)
                    if audio_format is not None:
                        data = model_input_to_format(pcm, audio_format)
                        content[-1]["audio"] = base64.b64encode(data).decode()
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": content}  # fmt: skip

    def truncate(self, audio_end_ms: int) -> None:
        """Keep the audio up to audio_end_ms and the transcript of the tokens spoken by then."""
        self.audio_ms = min(self.audio_ms, float(audio_end_ms))
        spoken = -(-audio_end_ms // FRAME_MS)
        self.pieces = [(n, t) for n, t in self.pieces if n <= spoken]
        self.status = "incomplete"

    def message(self) -> dict[str, Any] | None:
        """This item as one omni_ensemble message; None when nothing of it is left."""
        if self.role == "assistant":
            return {"role": "assistant", "content": self.text} if self.text else None
        if self.role == "system":
            return {"role": "system", "content": "".join(self.texts)}
        parts, texts, images, audios = [], iter(self.texts), iter(self.images), iter(self.audios)
        for kind in self.order:
            if kind == "input_text":
                parts.append({"type": "text", "text": next(texts)})
            elif kind == "input_image":
                parts.append({"type": "image_url", "image_url": {"url": next(images)}})
            else:
                data = base64.b64encode(next(audios)).decode()
                parts.append({"type": "input_audio", "input_audio": {"data": data, "format": "pcm"}})
        return {"role": "user", "content": parts}


@dataclass
class FunctionCall:
    """The assistant's call of a function: the model's, or one a client replays into the history."""

    name: str
    arguments: str  # JSON text, as the model wrote it
    call_id: str = field(default_factory=lambda: new_id("call"))
    id: str = field(default_factory=lambda: new_id("item"))
    status: str = "completed"

    @property
    def nbytes(self) -> int:
        return ITEM_BYTES + len(self.name) + len(self.arguments) + len(self.call_id)

    def public(self, audio_format: str | None = None) -> dict[str, Any]:
        # while in progress the arguments are still to come, in response.function_call_arguments.delta
        return {"id": self.id, "object": "realtime.item", "type": "function_call", "status": self.status,
                "call_id": self.call_id, "name": self.name,
                "arguments": "" if self.status == "in_progress" else self.arguments}  # fmt: skip

    def message(self) -> dict[str, Any]:
        call = {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}


@dataclass
class FunctionCallOutput:
    """The client's result of a function call, for the model to read in its next response."""

    call_id: str
    output: str
    id: str = field(default_factory=lambda: new_id("item"))
    status: str = "completed"

    @property
    def nbytes(self) -> int:
        return ITEM_BYTES + len(self.call_id) + len(self.output)

    def public(self, audio_format: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "function_call_output", "status": self.status,
                "call_id": self.call_id, "output": self.output}  # fmt: skip

    def message(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.output}


AnyItem = Item | FunctionCall | FunctionCallOutput


def audio_item(pcm16_16k: bytes) -> Item:
    return Item(role="user", audios=[pcm16_16k], order=["input_audio"])


def item_from_client(item: Any, input_format: str) -> AnyItem:
    """conversation.item.create's `item`; EventError names the bad field."""
    if not isinstance(item, dict):
        raise EventError("'item' must be an object", code="invalid_type", param="item")
    kind = item.get("type", "message")
    if kind == "function_call":
        out: AnyItem = FunctionCall(get(item, "name", str, where="item."), get(item, "arguments", str, where="item."))
        out.call_id = get(item, "call_id", str, required=False, where="item.") or out.call_id
    elif kind == "function_call_output":
        out = FunctionCallOutput(get(item, "call_id", str, where="item."), get(item, "output", str, where="item."))
    elif kind == "message":
        out = _message(item, input_format)
    else:
        raise EventError(f"item.type {kind!r} is not supported: message, function_call and function_call_output "
                         "items are", code="unsupported", param="item.type")  # fmt: skip
    if isinstance(item.get("id"), str) and item["id"]:
        out.id = item["id"][:64]
    return out


def _message(item: dict[str, Any], input_format: str) -> Item:
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        raise EventError("item.role must be user, assistant or system", param="item.role")
    content = get(item, "content", list, where="item.")
    out = Item(role=role, status="completed")
    allowed = {"user": ("input_text", "input_audio", "input_image"), "system": ("input_text",),
               "assistant": ("output_text", "output_audio", "text")}[role]  # fmt: skip
    for i, part in enumerate(content):
        where = f"item.content[{i}]."
        if not isinstance(part, dict) or part.get("type") not in allowed:
            raise EventError(f"item.content[{i}].type must be one of {', '.join(allowed)} for a {role} item",
                             param=f"item.content[{i}].type")  # fmt: skip
        kind = part["type"]
        if kind == "input_text":
            out.texts.append(get(part, "text", str, where=where))
        elif kind == "input_image":
            url = get(part, "image_url", str, where=where)
            if not url.startswith("data:image/"):
                raise EventError("image_url must be a data:image/... URL", param=f"{where}image_url")
            out.images.append(url)
        elif kind == "input_audio":
            out.audios.append(_client_audio(get(part, "audio", str, where=where), input_format, f"{where}audio"))
        else:  # assistant text or transcript (audio the client sends for an assistant item is not needed)
            text = get(part, "transcript" if kind == "output_audio" else "text", str, where=where)
            out.pieces.append((len(out.pieces) + 1, text))
            out.audio_out = out.audio_out or kind == "output_audio"
        out.order.append(kind)
    if not content:
        raise EventError("item.content must not be empty", param="item.content")
    return out


def _client_audio(data: str, input_format: str, param: str) -> bytes:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise EventError(f"{param} is not valid base64", code="invalid_base64", param=param) from None
    audio = InputAudio(input_format)
    samples = np.concatenate([audio.feed(raw), audio.flush()])
    return np.rint(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


class Conversation:
    def __init__(self) -> None:
        self.id = new_id("conv")
        self.items: list[AnyItem] = []
        # the items' nbytes as each was added (a reply grows after that, bounded by the token limit), as a
        # running sum: the limit is checked on every item a client adds
        self.nbytes = 0
        self._counted: dict[str, int] = {}

    def add(self, item: AnyItem, previous_item_id: str | None = None) -> str | None:
        """Insert after previous_item_id (at the end when None); returns the id of the item before it."""
        if any(i.id == item.id for i in self.items):
            raise EventError(f"item id {item.id!r} already exists", code="item_exists", param="item.id")
        if previous_item_id is None:
            before, at = (self.items[-1].id if self.items else None), len(self.items)
        elif previous_item_id == "root":
            before, at = None, 0
        else:
            before, at = previous_item_id, self.index(previous_item_id, "previous_item_id") + 1
        self.items.insert(at, item)
        self._counted[item.id] = size = item.nbytes
        self.nbytes += size
        return before

    def index(self, item_id: str, param: str = "item_id", code: str = "item_not_found") -> int:
        """`code` names the miss as OpenAI does for the event at hand (item_retrieve_invalid_item_id, ...):
        clients match on it to tell a benign race (an item already gone) from a fatal error."""
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise EventError(f"no item with id {item_id!r}", code=code, param=param)

    def get(self, item_id: str, param: str = "item_id", code: str = "item_not_found") -> AnyItem:
        return self.items[self.index(item_id, param, code)]

    def delete(self, item_id: str) -> None:
        del self.items[self.index(item_id)]
        self.nbytes -= self._counted.pop(item_id, 0)

    def messages(self, instructions: str, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """The prompt: the instructions (with the tools offered, chat format) and the items."""
        out = [{"role": "system", "content": instructions}] if instructions else []
        for message in (item.message() for item in self.items):
            if message is None:
                continue
            if message.get("tool_calls") and out and out[-1]["role"] == "assistant":
                # a reply's calls follow its text: one assistant turn, as the model wrote it
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", ()), *message["tool_calls"]]}
            else:
                out.append(message)
        return prompt_messages(out, tools)
