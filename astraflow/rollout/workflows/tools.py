"""``multi_turn_tools``: the model calls tools between turns; tool output is masked out of the loss.

A turn ends at ``</tool>`` (a stop string), EOS or the token budget. A tool call is either
``<tool>name(arguments)</tool>`` or ``<tool>{"name": ..., "arguments": ...}</tool>``. The
workflow runs the tool, appends ``<result>output</result>`` as inserted tokens (loss_mask 0,
logprob 0, version of the turn before), passes a safe point (the node may apply new weights
there: the next turn's tokens then carry the new version), and generates again. An episode
ends when a turn makes no tool call, or after ``max_turns`` turns (``MultiTurnToolsOptions``). The reward scores
the text of the last turn.

Tools are registered by name (``TOOLS.register``; a plug-in module in ``rollout.plugins`` or an entry
point in the group ``astraflow.tool`` adds more); built in: ``calculator`` (exact arithmetic
on +, -, *, /, //, %, ** and parentheses) and ``search`` (keyword search over the task's
``meta["corpus"]``, or a small built-in corpus); ``bm25`` (``retrieval``: a BM25 index over a
corpus file shipped with the recipe).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from astraflow.registry import WORKFLOWS, Registry
from astraflow.rollout.rewards import Reward
from astraflow.rollout.workflows.base import Episode, Evaluation, PolicyHandle, by_policy, min_version
from astraflow.rollout.workflows.options import MultiTurnToolsOptions
from astraflow.streams.messages import Task, Trajectory

Tool = Callable[[str, dict[str, Any]], str]
"""``tool(arguments, task_meta) -> output text``; raising is fine (the error text becomes the output)."""
TOOLS: Registry[Tool] = Registry("tool", "astraflow.rollout.workflows.tools", "astraflow.rollout.workflows.retrieval",
                                 plugins="rollout.plugins")
TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
_CALL = re.compile(r"<tool>\s*(.*?)\s*</tool>", re.S)
_NAMED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)$", re.S)


def parse_tool_call(text: str) -> tuple[str, str] | None:
    """``(name, arguments)`` of the last tool call in ``text``, or None."""
    calls = _CALL.findall(text)
    if not calls:
        return None
    body = calls[-1].strip()
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("args", ""))
        return obj["name"], args if isinstance(args, str) else json.dumps(args)
    m = _NAMED.match(body)
    return (m.group(1), m.group(2).strip()) if m else None


def run_tool(name: str, args: str, meta: dict[str, Any], allowed: list[str]) -> str:
    if name not in allowed or name not in TOOLS:
        return f"error: unknown tool {name!r}; available: {', '.join(t for t in allowed if t in TOOLS)}"
    try:
        return str(TOOLS.get(name)(args, meta))[:2000]
    except Exception as e:  # a tool error is an observation, not a crash
        return f"error: {type(e).__name__}: {e}"[:500]


_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


@TOOLS.register("calculator")
def calculator(args: str, meta: dict[str, Any]) -> str:
    value = _eval(ast.parse(args.strip().strip("\"'"), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


BUILTIN_CORPUS = [
    "Paris is the capital of France.",
    "The Nile is the longest river in Africa.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Mount Everest is the highest mountain above sea level.",
    "The speed of light in vacuum is 299792458 metres per second.",
]


@TOOLS.register("search")
def search(args: str, meta: dict[str, Any]) -> str:
    """The corpus document sharing the most words with the query (ties: the first)."""
    corpus = meta.get("corpus") or BUILTIN_CORPUS
    words = set(re.findall(r"\w+", args.lower()))
    scored = [(len(words & set(re.findall(r"\w+", doc.lower()))), -i, doc) for i, doc in enumerate(corpus)]
    best = max(scored)
    return best[2] if best[0] > 0 else "no results"


@WORKFLOWS.register("multi_turn_tools", MultiTurnToolsOptions)
class MultiTurnTools:
    policies = ("solver",)
    evaluation: Evaluation = "workflow"  # scored with its tools

    def __init__(self, reward: Reward, options: MultiTurnToolsOptions) -> None:
        self.reward = reward
        self.max_turns = options.max_turns
        self.tools = list(options.tools)

    def run(self, tasks: list[Task], policies: Mapping[str, PolicyHandle], node_id: str) -> list[Trajectory]:
        out: list[Trajectory] = []
        for policy, group in by_policy(tasks).items():
            out += self.run_policy(group, policies[policy], policy, node_id)
        return out

    def run_policy(self, tasks: list[Task], h: PolicyHandle, policy: str, node_id: str) -> list[Trajectory]:
        params = replace(h.params, stop=tuple(dict.fromkeys((*h.params.stop, TOOL_CLOSE))))
        samples = [(t, i, Episode(h.encode(t.prompt))) for t in tasks for i in range(t.group_size)]
        last_text = {id(ep): "" for _, _, ep in samples}
        calls = {id(ep): 0 for _, _, ep in samples}
        active = [s for s in samples if not s[2].fit(h.context)]
        need = max(min_version(t, policy) for t in tasks)
        for turn in range(self.max_turns):
            comps = h.generate(h.requests([ep.context() for _, _, ep in active], params), need)
            still = []
            for (task, i, ep), c in zip(active, comps):
                ep.add_generated(c)
                text = h.decode(c.token_ids)
                last_text[id(ep)] = text
                call = parse_tool_call(text) if text.rstrip().endswith(TOOL_CLOSE) else None
                if call is None:
                    continue
                if turn == self.max_turns - 1:
                    ep.finish_reason = "length"  # wanted another turn, had none left
                    continue
                result = run_tool(call[0], call[1], task.meta, self.tools)
                ep.add_inserted(h.encode(f"<result>{result}</result>"))
                calls[id(ep)] += 1
                if not ep.fit(h.context):  # a full context ends the episode here
                    still.append((task, i, ep))
            active = still
            if not active:
                break
            h.safe_point()  # between turns: new weights may land here; the next tokens say so
        return [ep.trajectory(task, policy, i, task.group_size, self.reward(_answer(last_text[id(ep)]), task.meta), node_id,
                              {"tool_calls": calls[id(ep)]})
                for task, i, ep in samples]


def _answer(text: str) -> str:
    """The last turn's text without any tool call in it."""
    return _CALL.sub("", text).strip()
