# The function tools of a session or a response: `tools` and `tool_choice` checked (a function is checked as
# the chat API checks one), and the tools the prompt offers, in the chat API's shape, so that tool_calls.py
# renders them into the system turn exactly as the chat path does.
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from openai_frontend.realtime.events import EventError
from openai_frontend.schemas import Tool
from openai_frontend.tool_calls import offered_tools

MAX_TOOLS = 128  # as the chat API's
TOOL_KEYS = ("type", "name", "description", "parameters")  # a GA realtime function tool
CHOICES = ("auto", "none", "required")
# MCP tools need the server to call MCP servers itself; this one runs no tools, it returns calls to the client
_NO_MCP = ("MCP tools are not supported: this server connects to no MCP server; declare the tools as functions "
           "and run them in the client")  # fmt: skip


def function_tools(value: Any, param: str) -> list[dict[str, Any]]:
    """The tools as the client gave them (session.updated echoes them); EventError names the first bad field."""
    if not isinstance(value, list):
        raise EventError(f"'{param}' must be an array", code="invalid_type", param=param)
    if len(value) > MAX_TOOLS:
        raise EventError(f"at most {MAX_TOOLS} tools", param=param)
    names: set[str] = set()
    for i, tool in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise EventError(f"'{where}' must be an object", code="invalid_type", param=where)
        if tool.get("type") == "mcp":
            raise EventError(_NO_MCP, code="unsupported", param=f"{where}.type")
        for key in tool:
            if key not in TOOL_KEYS:
                raise EventError(f"unknown parameter '{where}.{key}'", code="unknown_parameter", param=f"{where}.{key}")
        name = chat_tool(tool, where)["function"]["name"]
        if name in names:
            raise EventError(f"two tools are named {name!r}", param=f"{where}.name")
        names.add(name)
    return [dict(tool) for tool in value]


def chat_tool(tool: dict[str, Any], where: str = "tool") -> dict[str, Any]:
    """A realtime function tool in the chat API's shape ({type, function: {name, description, parameters}})."""
    try:
        checked = Tool.model_validate({"type": tool.get("type", "function"),
                                       "function": {k: v for k, v in tool.items() if k != "type"}})  # fmt: skip
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join([where, *(str(p) for p in first["loc"] if p != "function")])
        raise EventError(f"{param}: {first['msg']}", param=param) from None
    return checked.model_dump(exclude_none=True)


def tool_choice(value: Any, param: str) -> str | dict[str, str]:
    if isinstance(value, str) and value in CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "mcp":
        raise EventError(_NO_MCP, code="unsupported", param=param)
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str) and \
            set(value) == {"type", "name"}:  # fmt: skip
        return {"type": "function", "name": value["name"]}
    raise EventError(f"{param} must be 'auto', 'none', 'required' or {{\"type\": \"function\", \"name\": ...}}",
                     param=param)  # fmt: skip


def check_choice(tools: list[dict[str, Any]], choice: str | dict[str, str], param: str) -> None:
    """The chat API's rule: a named function must be one of the tools, and "required" needs tools."""
    if isinstance(choice, dict) and choice["name"] not in {t["name"] for t in tools}:
        raise EventError(f"tool_choice names {choice['name']!r}, which is not in tools", param=param)
    if choice == "required" and not tools:
        raise EventError("tool_choice 'required' needs tools", param=param)


def prompt_tools(tools: list[dict[str, Any]], choice: str | dict[str, str]) -> list[dict[str, Any]] | None:
    """The tools the prompt offers (chat format), None for none: tool_calls.offered_tools decides, as for chat."""
    chat = [chat_tool(t) for t in tools]
    if isinstance(choice, dict):
        return offered_tools(chat, None, choice["name"])
    return offered_tools(chat, choice)
