"""Tool calling as OpenAI clients expect it: the ``tools`` a chat call declares, and the calls read back from the model's text.

The model writes a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes format of
Qwen's chat templates, and of ``chat_template.CHAT_TEMPLATE``), one block per call. :func:`read_calls` turns a
completion into OpenAI ``tool_calls``; a block that is not that JSON, names a function the call did not
declare, or is left open is a parse failure: the whole text comes back as content, as OpenAI-compatible
servers answer, and the tokens are recorded as sampled either way.

``tool_choice`` is honoured without constrained decoding, by what the model is given to continue:

- ``auto``: the model decides;
- ``none``: ``<tool_call>`` is a stop string, so a turn ends where a call would begin;
- ``required``: the turn begins with ``<tool_call>{"name": "`` written for the model;
- a named function: the turn begins with ``<tool_call>{"name": "NAME", "arguments": ``.

The written prefix is prompt, not sample: it is never trained, and the trainer's ratios condition on it as
the engine did. ``parallel_tool_calls: false`` makes ``</tool_call>`` a stop string: at most one call a turn.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from astraflow.chat_template import CALL_CLOSE, CALL_OPEN
from astraflow.rollout.workflows.openai_errors import BadRequest

Mode = Literal["auto", "none", "required", "function"]
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


@dataclass(frozen=True)
class ToolUse:
    """The tools of one call and how they may be used."""

    tools: tuple[dict[str, Any], ...]  # as the request gave them: {"type": "function", "function": {...}}
    mode: Mode = "auto"
    function: str | None = None  # mode "function": the one to call
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    def prefix(self) -> str:
        """What the turn begins with, written for the model."""
        if self.mode == "required":
            return CALL_OPEN + '{"name": "'
        if self.mode == "function":
            return CALL_OPEN + '{"name": ' + json.dumps(self.function) + ', "arguments": '
        return ""

    def stops(self) -> tuple[str, ...]:
        if self.mode == "none":
            return (CALL_OPEN,)
        return () if self.parallel else (CALL_CLOSE,)


@dataclass(frozen=True)
class Reading:
    """A completion's text as the client gets it: content and calls, or the whole text when a call did not parse."""

    content: str | None
    calls: tuple[dict[str, Any], ...] = ()  # OpenAI tool_calls: {"id", "type": "function", "function": {"name", "arguments"}}
    failed: bool = False


def _function(k: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{k}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - _TOOL_KEYS:
        raise BadRequest(f"{where} must be {{type: function, function: {{name, description, parameters}}}}: "
                         "only function tools are served", where)
    f = tool.get("function")
    if not isinstance(f, dict) or set(f) - _FUNCTION_KEYS or not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
        raise BadRequest(f"{where}.function needs a name of letters, digits, _ or - (at most 64), and only "
                         f"{sorted(_FUNCTION_KEYS)}", f"{where}.function")
    if not isinstance(f.get("description", ""), str) or not isinstance(f.get("parameters", {}), dict):
        raise BadRequest(f"{where}.function: description is text and parameters a JSON schema object", f"{where}.function")
    return tool


def _choice(choice: Any, names: set[str]) -> tuple[Mode, str | None]:
    if choice is None or choice in ("auto", "none", "required"):
        return (choice or "auto"), None
    named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(name, str):
        raise BadRequest("tool_choice is auto, none, required or {type: function, function: {name}}", "tool_choice")
    if name not in names:
        raise BadRequest(f"tool_choice names {name!r}, which is not among the tools {sorted(names)}", "tool_choice")
    return "function", name


def parse_tools(body: dict[str, Any]) -> ToolUse | None:
    """The ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request, checked; None without tools."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise BadRequest("tools must be a list of at most 128 function tools", "tools")
    checked = tuple(_function(k, t) for k, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise BadRequest(f"tools must have distinct names, got {names}", "tools")
    mode, function = _choice(choice, set(names))
    return ToolUse(checked, mode, function, parallel is not False)


def _call(body: str, names: frozenset[str]) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names or set(obj) - {"name", "arguments"}:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string, as the API sends them
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    arguments = json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


def read_calls(text: str, use: ToolUse | None) -> Reading:
    """The client's view of ``text`` (the turn's prefix included): its tool calls and the content outside them."""
    if use is None or use.mode == "none":
        return Reading(text)
    bodies = _BLOCK.findall(text)
    rest = _BLOCK.sub("", text)
    if not bodies and CALL_OPEN not in rest:
        return Reading(text)
    calls = [_call(b.strip(), use.names) for b in bodies]
    if CALL_OPEN in rest or any(c is None for c in calls) or (not use.parallel and len(calls) > 1):
        return Reading(text, failed=True)
    return Reading(rest.strip() or None, tuple(c for c in calls if c is not None))
