"""Episodes of the CPU `alfworld` recipe, and its noisy demonstrations.

Writes, next to this file:

- ``rooms.jsonl``: one seed a line; each seed is one instance of the bundled ``rooms`` game (where the
  four objects lie, which one goes into which receptacle). Held-out seeds are never trained on;
- ``demos.jsonl``: the warm start's episodes, played through the recipe's own workflow against the real
  game by a noisy demonstrator. A careful one walks the rooms until it sees the object the task names,
  takes it, walks to the room of the task's receptacle and puts it there. A careless one takes the
  first object it sees, whatever the task names, and puts that one in the task's receptacle (right only
  when the first object it sees is the one asked for; a wrong object there ends the task unpaid).

Run: ``python recipes/alfworld/make_data.py`` (deterministic).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from astraflow.rollout.envs.games import Rooms
from astraflow.rollout.experts import Expert, record_recipe_demonstrations
from astraflow.streams.messages import Task

HERE = Path(__file__).resolve().parent
EPISODES = 600
CAREFUL = 0.4  # share of demonstrations that take the object the task names; the others take the first one they see.
# At 0.3 RL did not move held-out (an earlier run, in the git history of BENCHMARKS.md); at 0.4 greedy v0 is still
# careless but samples try the careful path.
ROOM_OF = {rec: room for room, rec in Rooms.RECEPTACLES.items()}


def careful_or_careless(rng: random.Random) -> Expert:
    careful = rng.random() < CAREFUL
    state: dict[str, str | None] = {"holding": None}
    visited: set[str] = set()

    def expert(task: Task, context: str) -> str:
        goal_obj, goal_rec = re.search(r"Your task: put the (\w+) in the (\w+)\.", context).groups()  # type: ignore[union-attr]
        room, seen = re.findall(r"You are in the (\w+)\. You see: (.*?); a \w+\.", context)[-1]
        visible = [] if seen == "nothing" else seen.split(", ")
        visited.add(room)
        if state["holding"] is None:
            pick = goal_obj if goal_obj in visible else None
            if not careful and visible:
                pick = visible[0]
            if pick is not None:
                state["holding"] = pick
                return f"take {pick}\n"
            return f"go to {next(r for r in Rooms.ROOMS if r not in visited)}\n"
        if room != ROOM_OF[goal_rec]:
            return f"go to {ROOM_OF[goal_rec]}\n"
        return f"put {state['holding']} in {goal_rec}\n"

    return expert


def main() -> None:
    rows = [{"id": f"rooms-{i}", "prompt": "", "answer": "", "seed": i} for i in range(EPISODES)]
    (HERE / "rooms.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    demos = record_recipe_demonstrations(HERE, careful_or_careless)
    n = len(demos)
    print(f"{len(rows)} episodes, {n} demonstrations, mean reward {sum(d.reward or 0 for d in demos) / n:.2f}")


if __name__ == "__main__":
    main()
