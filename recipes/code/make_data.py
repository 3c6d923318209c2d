"""Tiny programs for the CPU `code` recipe (checked by executed tests), and its noisy demonstrations.

Writes, next to this file:

- ``problems.jsonl``: "# kadon(x): x times 7 plus 3" with the reference solution and three ``assert`` tests
  that the ``code`` reward runs in the sandbox. Each problem names a made-up function with its own
  constants; held-out problems are never trained on;
- ``demos.jsonl``: the warm start's episodes, played through the recipe's own workflow by a noisy
  demonstrator. A careful one writes the function with ``return``; a careless one prints the value
  instead of returning it (the tests fail: the function returns None).

Run: ``python recipes/code/make_data.py`` (deterministic).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from astraflow.rollout.experts import Expert, record_recipe_demonstrations
from astraflow.streams.messages import Task

HERE = Path(__file__).resolve().parent
PROBLEMS = 600
CAREFUL = 0.3  # share of demonstrations that return the value; the others print it
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"
OPS = {"plus": "+", "minus": "-", "times": "*"}


def body(prompt: str) -> tuple[str, str]:
    """(function name, Python expression) of a problem's prompt: "# kadon(x): x times 7 plus 3"."""
    name, spec = re.match(r"# (\w+)\(x\): (.*)", prompt).groups()  # type: ignore[union-attr]
    return name, "".join(OPS.get(w, w) for w in spec.split())


def careful_or_careless(rng: random.Random) -> Expert:
    careful = rng.random() < CAREFUL

    def expert(task: Task, context: str) -> str:
        name, expr = body(task.prompt)
        return f"def {name}(x):\n    {'return ' + expr if careful else 'print(' + expr + ')'}\n"

    return expert


def main() -> None:
    rng = random.Random(0)
    rows, names = [], set()
    while len(rows) < PROBLEMS:
        name = "".join(rng.choice(CONSONANTS if i % 2 == 0 else VOWELS) for i in range(5))
        if name in names:
            continue
        names.add(name)
        a, b, op = rng.randint(2, 9), rng.randint(1, 9), rng.choice(["plus", "minus"])
        prompt = f"# {name}(x): x times {a} {op} {b}\n"
        _, expr = body(prompt)
        tests = [f"assert {name}({x}) == {eval(expr)}" for x in (1, 4, 10)]
        reference = f"def {name}(x):\n    return {expr}\n"
        rows.append({"id": f"code-{name}", "prompt": prompt, "answer": reference, "reference": reference, "tests": tests})
    (HERE / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    demos = record_recipe_demonstrations(HERE, careful_or_careless)
    n = len(demos)
    print(f"{len(rows)} problems, {n} demonstrations, mean reward {sum(d.reward or 0 for d in demos) / n:.2f}")


if __name__ == "__main__":
    main()
