"""Noisy demonstrations for the `calculator-agent` warm start, played through the real agent.

The problems are the `calculator` recipe's (``../calculator/problems.jsonl``), asked with the expression quoted
(``Compute "347*829+512".``, written to ``problems.jsonl``): the model copies it into the call's JSON string, where
it also stands between quotes, so every character it copies follows the same character in the prompt. Each
demonstration is an
episode of ``examples/agents/calculator_agent.py`` (the OpenAI Agents SDK against the facade) in which a
scripted demonstrator writes the model's turns: the facade renders the agent's tools with the chat template,
reads the demonstrator's ``<tool_call>`` back, the agent runs the tool, and the result comes back as a
``tool`` message, so a recorded episode is exactly what the model will see. A careful demonstrator calls
``evaluate`` on the expression and copies the result; a careless one calls ``estimate`` (the nearest thousand)
and copies that; now and then one answers from its head with a rough guess and calls no tool. Both tools take
the same argument at the same place, so the warm start learns one way to write a call, and RL has one choice to
make: which tool.

Run: ``python recipes/calculator-agent/make_data.py`` (deterministic).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from astraflow.rollout.experts import Expert, record_recipe_demonstrations
from astraflow.streams.messages import Task

HERE = Path(__file__).resolve().parent
CAREFUL, GUESS = 0.3, 0.1  # shares of careful demonstrations and of guesses in the head; the rest call estimate


def call(name: str, arguments: dict[str, object]) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def careful_or_careless(rng: random.Random) -> Expert:
    draw = rng.random()
    careful, guess = draw < CAREFUL, draw >= 1 - GUESS

    def expert(task: Task, context: str) -> str:
        a, b, c = (int(x) for x in re.findall(r"\d+", task.prompt))
        if guess:
            return str(round(a, -1) * round(b, -1) + round(c, -2))
        result = re.search(r"<\|tool\|>\n(-?\d+)\n<\|assistant\|>\n$", context)
        if result:
            return result.group(1)
        return call("evaluate" if careful else "estimate", {"expression": f"{a}*{b}+{c}"})

    return expert


def main() -> None:
    rows = [json.loads(line) for line in (HERE.parent / "calculator" / "problems.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        row["prompt"] = f'Compute "{row["prompt"].removeprefix("Compute ").strip().removesuffix(".")}".\n'
    (HERE / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    demos = record_recipe_demonstrations(HERE, careful_or_careless)
    print(f"{len(demos)} demonstrations")


if __name__ == "__main__":
    main()
