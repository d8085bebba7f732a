# vLLM-Omni's response style, for clients written against it (e.g. its benchmark): every stream chunk has
# a top-level `modality` ("text" | "audio"); an audio chunk carries one self-contained file (WAV unless
# audio.format says otherwise), base64, in `delta.content`. Non-streamed: one choice per output
# modality, text first (choices[0].message.content), then audio (choices[1].message.audio.data).
from __future__ import annotations

from typing import Any

from openai_frontend.audio_encoding import encode_audio
from openai_frontend.chat_render import ResponseIds, audio_object, b64, choice, chunk, completion, message


class VllmOmniStyle:
    def __init__(self, ids: ResponseIds, *, text_out: bool, audio_out: bool, audio_format: str):
        self.ids, self.text_out, self.audio_out, self.audio_format = ids, text_out, audio_out, audio_format

    def completion(self, text: str, audio: bytes | None, finish_reason: str, usage: dict[str, Any],
                   tool_calls: list[dict[str, Any]], expires_at: int) -> dict[str, Any]:
        choices = []
        if self.text_out or tool_calls:
            choices.append(choice(0, message(text if self.text_out else None, tool_calls), finish_reason))
        if audio is not None:
            spoken = {"role": "assistant", "content": None, "audio": audio_object(self.ids, audio, text, expires_at)}
            choices.append(choice(len(choices), spoken, finish_reason))
        return completion(self.ids, choices, usage)

    def opening(self) -> list[dict[str, Any]]:
        # audio-only: no empty opener, since clients decode every `modality: audio` chunk as a file
        return [chunk(self.ids, {"role": "assistant", "content": ""}, modality="text")] if self.text_out else []

    def piece(self, text: str, pcm16: bytes, tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        if text and self.text_out:
            out.append(chunk(self.ids, {"content": text}, modality="text"))
        if tool_calls:
            out.append(chunk(self.ids, {"tool_calls": tool_calls}, modality="text"))
        if pcm16:
            data = b64(encode_audio(pcm16, self.audio_format))
            out.append(chunk(self.ids, {"role": "assistant", "content": data}, modality="audio"))
        return out

    def closing(self, finish_reason: str, expires_at: int) -> list[dict[str, Any]]:
        # a text chunk even for ["audio"]: an empty text delta is harmless to every client, while a
        # `modality: audio` chunk without a file would break those that decode each one
        return [chunk(self.ids, {"content": ""}, finish_reason=finish_reason, modality="text")]
