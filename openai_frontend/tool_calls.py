# OpenAI tools on Qwen3-Omni, both ways, in the released chat template's format:
#  - into the prompt: the tool list goes to the end of the system message ("# Tools ... <tools>one JSON
#    per line</tools> ..."), an assistant turn's tool_calls become <tool_call>{"name", "arguments"}</tool_call>
#    blocks after its text, and consecutive `tool` messages become one user turn of <tool_response> blocks.
#    The ensemble then renders plain role/content messages, whichever template the checkpoint ships.
#  - out of the reply: <tool_call> blocks in the thinker's text become OpenAI tool_calls (ToolCallSplitter).
from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # as the template's `tojson`


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def _call_block(call: dict[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    # text as the client sent it (the template pastes a string as it is); blank text is an empty object, so the
    # block stays JSON
    if not isinstance(arguments, str):
        arguments = _json(arguments)
    elif not arguments.strip():
        arguments = "{}"
    return f'{OPEN}\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n{CLOSE}'


def prompt_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI messages (tool roles and tool_calls included) and the tools the prompt offers, as plain
    role/content messages."""
    out: list[dict[str, Any]] = []
    if tools:
        block = _TOOLS_HEADER + "".join("\n" + _json(t) for t in tools) + _TOOLS_FOOTER
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": _text(messages[0]["content"]) + "\n\n" + block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for message in messages:
        role = message["role"]
        if role == "tool":
            response = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
        elif role == "assistant" and message.get("tool_calls"):
            text = _text(message.get("content"))
            blocks = "\n".join(_call_block(c) for c in message["tool_calls"])
            out.append({"role": "assistant", "content": f"{text}\n{blocks}" if text else blocks})
        else:
            out.append({k: v for k, v in message.items() if k in ("role", "content")})
    for message in out:
        message.pop("tool_responses", None)
    return out


def offered_tools(tools: list[dict[str, Any]], choice: str | None, function: str | None = None
                  ) -> list[dict[str, Any]] | None:  # fmt: skip
    """The tools (chat format) the prompt offers for a tool_choice: "none" offers none, so the model writes no
    calls; a named `function` offers that one only; "auto", "required" or None offer them all. The model is
    asked, not forced: with "required" or a named function a reply may still be plain text."""
    if not tools or choice == "none":
        return None
    if function is not None:
        return [t for t in tools if t["function"]["name"] == function]
    return tools


def tool_call(name: str, arguments: Any, index: int) -> dict[str, Any]:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else _json(arguments)}}


class ToolCallSplitter:
    """Streamed reply text in, (plain text, complete tool calls) out. Text that may be the start of a
    <tool_call> tag is held back until it is known; a block that is not a JSON {"name", "arguments"}
    object stays text, as the model wrote it."""

    def __init__(self) -> None:
        self._held = ""
        self.calls = 0
        self.in_call = False  # inside a block: from here on the reply is a call, not speech

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        plain, calls = [], []
        while True:
            if not self.in_call:
                at = self._held.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._held, OPEN)
                    plain.append(self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    break
                plain.append(self._held[:at])
                self._held, self.in_call = self._held[at + len(OPEN):], True
            end = self._held.find(CLOSE)
            if end < 0:
                break
            body, self._held, self.in_call = self._held[:end], self._held[end + len(CLOSE):], False
            call = self._parse(body)
            if call is None:
                plain.append(OPEN + body + CLOSE)
            else:
                calls.append(call)
        text_out = "".join(plain)
        return (text_out if not self.calls or text_out.strip() else ""), calls

    def flush(self) -> str:
        """At the end of the reply: what is still held (an unclosed block stays text)."""
        held, self._held = (OPEN if self.in_call else "") + self._held, ""
        self.in_call = False
        return held

    def _parse(self, body: str) -> dict[str, Any] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        call = tool_call(value["name"], value.get("arguments", {}), self.calls)
        self.calls += 1
        return call


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
