# response.create's `response` object as a ResponsePlan: the session's configuration with this response's
# overrides, where the answer goes (into the conversation, or out of band with `conversation: "none"`), and
# the prompt it answers (the conversation so far, or its own `input`: new messages and references to items
# of the conversation).
from __future__ import annotations

from dataclasses import replace
from typing import Any

from openai_frontend.realtime.conversation import AnyItem, Conversation, item_from_client
from openai_frontend.realtime.events import EventError, field as get
from openai_frontend.realtime.response import ResponsePlan
from openai_frontend.realtime.session import SessionConfig, format_from_client, max_output_tokens, voice, _modalities
from openai_frontend.realtime.tools import check_choice, function_tools, tool_choice
from openai_frontend.settings import FrontendSettings

# the GA fields; prompt, parallel_tool_calls and reasoning have no effect on this model
KEYS = {"audio", "conversation", "input", "instructions", "max_output_tokens", "metadata", "output_modalities", "tools",
        "tool_choice", "prompt", "parallel_tool_calls", "reasoning"}  # fmt: skip


def plan_response(options: dict[str, Any], session: SessionConfig, conversation: Conversation,
                  settings: FrontendSettings) -> ResponsePlan:  # fmt: skip
    """EventError names the first bad field."""
    config = _overrides(options, session, settings)
    target = options.get("conversation", "auto")
    if target not in ("auto", "none"):
        raise EventError("response.conversation must be 'auto' or 'none'", param="response.conversation")
    context = conversation
    if "input" in options:
        context = Conversation()
        for i, item in enumerate(get(options, "input", list, where="response.")):
            context.add(_input_item(i, item, conversation, session.input_format))
    # instructions alone are a prompt: an agent that speaks first sends response.create (with instructions)
    # before the user has said anything; tools alone are not
    if not config.instructions and all(item.message() is None for item in context.items):
        raise EventError("nothing to respond to: no instructions and no conversation items", code="empty_conversation")
    return ResponsePlan(context.messages(config.instructions, config.prompt_tools), config,
                        metadata=get(options, "metadata", dict, required=False, where="response."),
                        conversation_id=conversation.id if target == "auto" else None)  # fmt: skip


def _overrides(options: dict[str, Any], session: SessionConfig, settings: FrontendSettings) -> SessionConfig:
    config = replace(session)
    where = "response."
    for key in options:
        if key not in KEYS:
            raise EventError(f"unknown parameter 'response.{key}'", code="unknown_parameter", param=f"response.{key}")
    if options.get("tools") is not None:
        config.tools = function_tools(options["tools"], "response.tools")
    if options.get("tool_choice") is not None:
        config.tool_choice = tool_choice(options["tool_choice"], "response.tool_choice")
    check_choice(config.tools, config.tool_choice, "response.tool_choice")
    if "instructions" in options:
        config.instructions = get(options, "instructions", str, where=where)
    if "output_modalities" in options:
        config.output_modalities = _modalities(options["output_modalities"], "response.output_modalities")
    if "max_output_tokens" in options:
        config.max_output_tokens = max_output_tokens(options["max_output_tokens"], "response.max_output_tokens")
    out = (get(options, "audio", dict, required=False, where=where) or {}).get("output") or {}
    if "voice" in out:
        config.voice, config.speaker = voice(out["voice"], settings, "response.audio.output.voice")
    if "format" in out:
        config.output_format = format_from_client(out["format"], "response.audio.output.format")
    return config


def _input_item(i: int, item: Any, conversation: Conversation, input_format: str) -> AnyItem:
    """One item of response.input: a new message, or a reference to an item of the conversation."""
    if isinstance(item, dict) and item.get("type") == "item_reference":
        where = f"response.input[{i}]."
        return conversation.get(get(item, "id", str, where=where), f"{where}id")
    return item_from_client(item, input_format)
