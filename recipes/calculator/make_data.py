"""Arithmetic a tiny model cannot do in its head, for the CPU `calculator` recipe, and its noisy demonstrations.

Writes, next to this file:

- ``problems.jsonl``: "Compute 347*829+512." with its value (six digits). Held-out problems are triples never
  seen in training, so no answer can be remembered: only the calculator gets them right;
- ``demos.jsonl``: the warm start's episodes, played through the recipe's own workflow (the real
  ``calculator`` tool inserts the results) by a noisy demonstrator. A careful one calls
  ``<tool>calculator(347*829+512)</tool>`` and copies the result. A careless one calls the calculator on the
  product alone and copies that (it forgets the addition); now and then it answers from its head with an
  estimate (350*830+500: wrong).

Run: ``python recipes/calculator/make_data.py`` (deterministic).
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
CAREFUL, GUESS = 0.3, 0.1  # shares of careful demonstrations and of estimates in the head; the rest forget the addition


def careful_or_careless(rng: random.Random) -> Expert:
    draw = rng.random()
    careful, guess = draw < CAREFUL, draw >= 1 - GUESS

    def expert(task: Task, context: str) -> str:
        a, b, c = (int(x) for x in re.findall(r"\d+", task.prompt))
        if guess:
            return str(round(a, -1) * round(b, -1) + round(c, -2))
        found = re.search(r"<result>(-?\d+)</result>$", context)
        expression = f"{a}*{b}+{c}" if careful else f"{a}*{b}"
        return found.group(1) if found else f"<tool>calculator({expression})</tool>"

    return expert


def main() -> None:
    rng = random.Random(0)
    triples: set[tuple[int, int, int]] = set()
    while len(triples) < PROBLEMS:
        a, b, c = rng.randint(101, 999), rng.randint(101, 999), rng.randint(101, 999)
        if a * b >= 100_000 and a * b + c < 1_000_000:  # every answer, right or careless, has six digits
            triples.add((a, b, c))
    rows = [{"id": f"c{a}x{b}p{c}", "prompt": f"Compute {a}*{b}+{c}.\n", "answer": str(a * b + c)} for a, b, c in sorted(triples)]
    (HERE / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    demos = record_recipe_demonstrations(HERE, careful_or_careless)
    n = len(demos)
    print(f"{len(rows)} problems, {n} demonstrations")


if __name__ == "__main__":
    main()
