"""The OpenAI wire shapes the facade speaks: requests parsed and checked, responses and SSE chunks built.

Pure (no engine, no server): ``parse_call`` turns a request body into a :class:`ApiCall` or
raises :class:`BadRequest` naming the parameter; the ``*_response`` / ``*_chunks`` functions
turn generated :class:`Choice` values into the JSON bodies of ``/v1/chat/completions`` and
``/v1/completions``, whole or as server-sent events.

A parameter is honoured, accepted without effect on generation (``NO_EFFECT``: bookkeeping
fields), or refused with a 400 that says why. Nothing is silently ignored. Function tools
(``tools``, ``tool_choice``, ``parallel_tool_calls``, tool calls and ``tool`` messages in the history)
are served (``tool_calls.py``); structured outputs, penalties, logit bias and alternatives' logprobs
are refused, because the engines sample plain text from the policy and report the sampled token's
logprob only.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from astraflow.rollout.workflows.openai_errors import BadRequest
from astraflow.rollout.workflows.tool_calls import ToolUse, parse_tools

Kind = Literal["chat", "completion"]
ROLES = ("system", "developer", "user", "assistant", "tool")
NO_EFFECT = frozenset({"model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
_COMMON = frozenset({"max_tokens", "stop", "n", "seed", "temperature", "top_p", "stream", "stream_options", "logprobs",
                     "frequency_penalty", "presence_penalty", "logit_bias"}) | NO_EFFECT
ACCEPTED: dict[Kind, frozenset[str]] = {
    "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                       "response_format", "functions", "function_call"},
    "completion": _COMMON | {"prompt", "echo", "best_of", "suffix"},
}
MAX_N = 128


@dataclass(frozen=True)
class ApiCall:
    """One parsed request. ``None`` sampling values mean "the recipe's"."""

    kind: Kind
    model: str | None
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat
    prompt: str | list[int] = ""  # completion: text, or token ids
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    tools: ToolUse | None = None  # chat: the declared function tools and how they may be used


@dataclass(frozen=True)
class Choice:
    """One generated choice as the client sees it: the text (request stop strings trimmed) and every token's logprob."""

    text: str
    tokens: list[str]  # each generated token's text, the stop string and EOS included (what is trained)
    logprobs: list[float]
    finish_reason: str
    tool_calls: tuple[dict[str, Any], ...] = ()  # OpenAI tool_calls read from the text (then ``text`` is what is left)


def _unset(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {} or value == ""


def _refuse(body: dict[str, Any], name: str, why: str, allowed: tuple[Any, ...] = ()) -> None:
    value = body.get(name)
    if not _unset(value) and value not in allowed:
        raise BadRequest(f"{name} is not supported by the astraflow facade: {why}", name)


def _int(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise BadRequest(f"{name} must be an integer in [{low}, {high if high is not None else '∞'}), got {value!r}", name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them", "stop")
    return tuple(stops)


def _tool_calls(k: int, calls: Any) -> None:
    where = f"messages[{k}].tool_calls"
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("id"), str) and c.get("type", "function") == "function"
            and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments"), str) for c in calls):
        raise BadRequest(f"{where} must be a list of {{id, type: function, function: {{name, arguments}}}}", where)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{k}] must be an object with a role in {ROLES}", f"messages[{k}].role")
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise BadRequest(f"messages[{k}].tool_calls: only assistant messages carry tool calls", f"messages[{k}].tool_calls")
            _tool_calls(k, m["tool_calls"])
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise BadRequest(f"messages[{k}]: a tool message needs the tool_call_id it answers", f"messages[{k}].tool_call_id")
        content = m.get("content")
        parts = content if isinstance(content, list) else []
        if not (content is None or isinstance(content, (str, list))) or any(
                not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str) for p in parts):
            raise BadRequest(f"messages[{k}].content must be text (a string or text parts)", f"messages[{k}].content")
    return messages


def _prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return list(prompt)
    raise BadRequest("prompt must be one string or one list of token ids (one prompt per call)", "prompt")


def parse_call(kind: Kind, body: Any) -> ApiCall:
    """The request ``body`` of ``/v1/chat/completions`` (``chat``) or ``/v1/completions`` (``completion``), checked."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - ACCEPTED[kind])
    if unknown:
        known = ", ".join(sorted(ACCEPTED[kind]))
        raise BadRequest(f"parameter {unknown[0]!r} is not supported by the astraflow facade (it knows: {known})", unknown[0])
    sampling = "it changes the sampling distribution the trainer's importance ratios assume"
    for name in ("frequency_penalty", "presence_penalty", "logit_bias"):
        _refuse(body, name, sampling)
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise BadRequest("stream_options is {include_usage: bool}, with stream: true", "stream_options")
    model = body.get("model")
    call = ApiCall(kind, model=model if isinstance(model, str) else None, stop=_stop(body), n=_int(body, "n", 1, MAX_N) or 1,
                   seed=_int(body, "seed", -(2**63)), temperature=_number(body, "temperature", 0.0, 2.0),
                   top_p=_number(body, "top_p", 0.0, 1.0), stream=stream, include_usage=bool(options and options.get("include_usage")))
    if call.top_p == 0.0:
        raise BadRequest("top_p must be above 0", "top_p")
    if kind == "chat":
        legacy = "the legacy functions API is not served: declare them as tools"
        _refuse(body, "functions", legacy)
        _refuse(body, "function_call", legacy, ("none",))
        _refuse(body, "response_format", "structured outputs are not enforced; only {type: text}", ({"type": "text"},))
        _refuse(body, "top_logprobs", "the engines report the sampled token's logprob only")
        if not isinstance(body.get("logprobs", False), bool):
            raise BadRequest("logprobs must be a boolean", "logprobs")
        budget = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
        return replace(call, messages=_messages(body), max_tokens=budget, logprobs=bool(body.get("logprobs")), tools=parse_tools(body))
    _refuse(body, "echo", "the prompt is not echoed")
    _refuse(body, "suffix", "insertion is not supported")
    _refuse(body, "best_of", "every sample is returned (use n)", (1,))
    logprobs = _int(body, "logprobs", 0)
    if logprobs:
        raise BadRequest("logprobs must be 0 (the sampled tokens' logprobs): the engines report no alternatives", "logprobs")
    return replace(call, prompt=_prompt(body), max_tokens=_int(body, "max_tokens", 1), logprobs=logprobs == 0)


def trim_stop(text: str, stops: tuple[str, ...]) -> str:
    """``text`` up to the earliest stop string (OpenAI returns the text without it)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def usage(prompt_tokens: int, choices: list[int]) -> dict[str, int]:
    """The prompt counts once for all ``n`` choices; completions add up."""
    completion = sum(choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _chat_logprobs(c: Choice) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(c.tokens, c.logprobs, strict=True)], "refusal": None}


def _completion_logprobs(c: Choice) -> dict[str, Any]:
    offsets = [sum(len(t) for t in c.tokens[:k]) for k in range(len(c.tokens))]
    return {"tokens": c.tokens, "token_logprobs": c.logprobs, "top_logprobs": None, "text_offset": offsets}


def _head(call: ApiCall, obj: str, model: str, fingerprint: str) -> dict[str, Any]:
    prefix = "chatcmpl" if call.kind == "chat" else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": obj, "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint}


def _message(c: Choice) -> dict[str, Any]:
    if not c.tool_calls:
        return {"role": "assistant", "content": c.text, "refusal": None}
    return {"role": "assistant", "content": c.text or None, "refusal": None, "tool_calls": list(c.tool_calls)}


def response(call: ApiCall, choices: list[Choice], model: str, fingerprint: str, use: dict[str, int]) -> dict[str, Any]:
    """The whole (non-streaming) response body."""
    if call.kind == "chat":
        out = [{"index": k, "message": _message(c), "logprobs": _chat_logprobs(c) if call.logprobs else None,
                "finish_reason": c.finish_reason} for k, c in enumerate(choices)]
        return {**_head(call, "chat.completion", model, fingerprint), "choices": out, "usage": use}
    out = [{"index": k, "text": c.text, "logprobs": _completion_logprobs(c) if call.logprobs else None, "finish_reason": c.finish_reason}
           for k, c in enumerate(choices)]
    return {**_head(call, "text_completion", model, fingerprint), "choices": out, "usage": use}


def _deltas(c: Choice) -> list[dict[str, Any]]:
    """A chat choice's deltas after the role: its content, then each tool call's name and arguments."""
    out: list[dict[str, Any]] = [{"content": c.text}] if c.text or not c.tool_calls else []
    for j, t in enumerate(c.tool_calls):
        f = t["function"]
        out.append({"tool_calls": [{"index": j, "id": t["id"], "type": "function", "function": {"name": f["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": j, "function": {"arguments": f["arguments"]}}]})
    return out


def chunks(call: ApiCall, choices: list[Choice], model: str, fingerprint: str, use: dict[str, int]) -> Iterator[dict[str, Any]]:
    """The same response as server-sent event payloads: per choice its text and tool calls, then its finish; usage last if asked."""
    obj = "chat.completion.chunk" if call.kind == "chat" else "text_completion"
    head = _head(call, obj, model, fingerprint)
    extra = {"usage": None} if call.include_usage else {}
    for k, c in enumerate(choices):
        if call.kind == "chat":
            deltas = [{"role": "assistant", "content": ""}, *_deltas(c)]
            for d, delta in enumerate(deltas):
                logprobs = _chat_logprobs(c) if call.logprobs and d == 1 else None  # every token's, once
                yield {**head, "choices": [{"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": None}], **extra}
            yield {**head, "choices": [{"index": k, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}], **extra}
        else:
            x = {"index": k, "text": c.text, "logprobs": _completion_logprobs(c) if call.logprobs else None,
                 "finish_reason": c.finish_reason}
            yield {**head, "choices": [x], **extra}
    if call.include_usage:
        yield {**head, "choices": [], "usage": use}
