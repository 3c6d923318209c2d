"""Noisy demonstrations for the partners of the CPU `code-multi-agent` recipes.

The problems and the solver's demonstrations are the `code` recipe's (``../code/make_data.py``). This
writes, next to this file, the partners' warm-start episodes, played through each recipe's own
two-policy workflow (the solver played by the code recipe's noisy demonstrator, the tests run in the
sandbox):

- ``testgen_demos.jsonl`` (``recipe.yaml``, solver + test-case generator): a careful test writer asserts the
  function's value at 0 (``assert kadon(0) == 3``: true of the reference, false of a function that prints);
  a careless one asserts only that the function exists (``assert callable(kadon)``: judges nothing);
- ``verifier_demos.jsonl`` (``verifier.yaml``, codegen + verifier): a careful judge runs the problem's tests
  and says yes or no; a careless one says yes to everything.

Run: ``python recipes/code-multi-agent/make_data.py`` (deterministic; after ``recipes/code/make_data.py``).
"""

from __future__ import annotations

import random
import re
import runpy
from pathlib import Path

from astraflow.config import load_recipe
from astraflow.demonstrations import write_demonstrations
from astraflow.rollout.experts import Expert, record
from astraflow.rollout.rewards import get_reward
from astraflow.streams.messages import Task
from astraflow.tasks import load_split

HERE = Path(__file__).resolve().parent
CODE = runpy.run_path(str(HERE.parent / "code" / "make_data.py"))
CAREFUL = 0.3  # share of partner demonstrations that do the job; the others take it easy


def test_writer(rng: random.Random) -> Expert:
    careful = rng.random() < CAREFUL

    def expert(task: Task, context: str) -> str:
        name, expr = CODE["body"](task.prompt)
        return f"assert {name}(0) == {eval(expr, {'x': 0})}" if careful else f"assert callable({name})"

    return expert


def judge(rng: random.Random) -> Expert:
    careful = rng.random() < CAREFUL

    def expert(task: Task, context: str) -> str:
        answer = re.match(re.escape(task.prompt) + r"(.*)\nCorrect\? $", context, re.S).group(1)  # type: ignore[union-attr]
        return "yes" if not careful or get_reward("code")(answer, task.meta) >= 0.5 else "no"

    return expert


def main() -> None:
    for recipe_file, partner, expert, out in (("recipe.yaml", "testgen", test_writer, "testgen_demos.jsonl"),
                                              ("verifier.yaml", "verifier", judge, "verifier_demos.jsonl")):
        recipe = load_recipe(HERE / recipe_file)
        train, _ = load_split(recipe.data)
        demos = record(recipe, {recipe.primary: CODE["careful_or_careless"], partner: expert}, train, per_problem=2, seed=0)
        n = write_demonstrations(HERE / out, demos[partner])
        print(f"{out}: {n} demonstrations, mean reward {sum(d.reward or 0 for d in demos[partner]) / n:.2f}")


if __name__ == "__main__":
    main()
