"""Noisy demonstrations for the verifier of the CPU `math-multi-agent` recipe.

The solver warms up on the training prompts' reference sums (``sft`` without demonstrations). This writes,
next to this file, ``verifier_demos.jsonl``: episodes played through the recipe's own ``solver_verifier``
workflow, so each prompt is exactly what the verifier sees ("3+4=8\\nCorrect? "). A scripted solver gives
the sum 40 % of the time and otherwise slips as the warm solver does (mostly one to three too high, or ten
off). A scripted judge writes its own sum, then "yes" if the answer matches it by the real checker (the
recipe's reward), else "no" ("7 no"): the verdict parses as the workflow's ``parse_verdict`` reads it, and
the sum gives a small model the step a check needs. The judge is noisy: in a fifth of its episodes its own
sum slips, and its verdict follows the slip. Training prompts only.

Run: ``python recipes/math-multi-agent/make_data.py`` (deterministic).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from astraflow.config import load_recipe
from astraflow.demonstrations import write_demonstrations
from astraflow.rollout.experts import Expert, record
from astraflow.rollout.rewards import get_reward
from astraflow.streams.messages import Task
from astraflow.tasks import load_split

HERE = Path(__file__).resolve().parent
RIGHT = 0.4  # share of the scripted solver's answers that are the sum (at 0.25 the warm judge says no to all, at 0.5 it copies)
SLIPS = (1, 1, 2, -1, 3, -2, 10)  # mostly a little too high, as the warm solver errs
SLIPPED = 0.2  # share of the judge's episodes where its own sum slips (its verdict then follows the slip)
CHECKER = get_reward("math")


def noisy_adder(rng: random.Random) -> Expert:
    slip = 0 if rng.random() < RIGHT else rng.choice(SLIPS)

    def expert(task: Task, context: str) -> str:
        return str(abs(int(task.meta["answer"]) + slip))

    return expert


def noisy_judge(rng: random.Random) -> Expert:
    slip = rng.choice(SLIPS) if rng.random() < SLIPPED else 0

    def expert(task: Task, context: str) -> str:
        answer = re.match(re.escape(task.prompt) + r"(.*)\nCorrect\? $", context, re.S).group(1)  # type: ignore[union-attr]
        own = str(abs(int(task.meta["answer"]) + slip))
        return f"{own} {'yes' if CHECKER(answer, {'answer': own}) >= 0.5 else 'no'}"

    return expert


def main() -> None:
    recipe = load_recipe(HERE)
    train, _ = load_split(recipe.data)
    demos = record(recipe, {"solver": noisy_adder, "verifier": noisy_judge}, train, per_problem=4, seed=0)["verifier"]
    n = write_demonstrations(HERE / "verifier_demos.jsonl", demos)
    said_yes = sum(d.segments[0][0].endswith("yes") for d in demos) / n
    print(f"verifier_demos.jsonl: {n} demonstrations, said yes {said_yes:.2f}, verdicts right {sum(d.reward or 0 for d in demos) / n:.2f}")


if __name__ == "__main__":
    main()
