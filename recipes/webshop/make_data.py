"""Episodes of the CPU `webshop` recipe, and its noisy demonstrations.

Writes, next to this file:

- ``shop.jsonl``: one seed a line; each seed is one instance of the bundled ``shop`` game (a shuffled
  catalogue with prices, and the item to buy). Held-out seeds are never trained on;
- ``demos.jsonl``: the warm start's episodes, played through the recipe's own workflow against the real
  game by a noisy demonstrator. A careful one searches every wanted attribute
  (``search[red small shirt]``), opens the first result and buys it. A careless one searches the kind of
  item alone (``search[shirt]``), opens the first result and buys it, whatever its colour and size.

Run: ``python recipes/webshop/make_data.py`` (deterministic).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from astraflow.rollout.experts import Expert, record_recipe_demonstrations
from astraflow.streams.messages import Task

HERE = Path(__file__).resolve().parent
EPISODES = 600
CAREFUL = 0.3  # share of demonstrations that search every attribute; the others search the kind alone


def careful_or_careless(rng: random.Random) -> Expert:
    careful = rng.random() < CAREFUL

    def expert(task: Task, context: str) -> str:
        size, color, kind = re.search(r"Instruction: buy a (\w+) (\w+) (\w+)\.", context).groups()  # type: ignore[union-attr]
        results = re.findall(r"Results: (i\d+):", context)
        if "Item i" in context:
            return "buy\n"
        if results:
            return f"click[{results[-1]}]\n"
        return f"search[{color} {size} {kind}]\n" if careful else f"search[{kind}]\n"

    return expert


def main() -> None:
    rows = [{"id": f"shop-{i}", "prompt": "", "answer": "", "seed": i} for i in range(EPISODES)]
    (HERE / "shop.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    demos = record_recipe_demonstrations(HERE, careful_or_careless)
    n = len(demos)
    print(f"{len(rows)} episodes, {n} demonstrations, mean reward {sum(d.reward or 0 for d in demos) / n:.2f}")


if __name__ == "__main__":
    main()
