"""Episodes of the CPU `terminal` recipe, and its noisy demonstrations.

Writes, next to this file:

- ``episodes.jsonl``: one seed a line; each seed is one task of the bundled ``terminal`` game (a scratch
  directory with three files, one holding a made-up keyword; copy, move or delete that file). The recipe
  holds out 100 of them and trains on the other 3,000 (held-out episodes are never trained on; their
  keywords and file names are drawn at random, so a few recur in training episodes);
- ``demos.jsonl``: the warm start's episodes, two of each of the first 500 training episodes only (RL draws
  from all 3,000, so most of its episodes are new to the policy), played through the recipe's own workflow
  against the real game (every command runs in the sandbox) by a noisy demonstrator. Both look first
  (``grep -l WORD *.txt``). A careful one (half of them) acts on the file the output names, then exits; a
  careless one does not read the output and forces an act on the first file listed (``cp -f``, ``mv -f``,
  ``rm -f``; right one time in three), then exits. The careless habit has a form of its own, so the two
  habits part at the character after the verb: when they parted only at the file name's first letter, the
  byte-level model blended the two names into a file that does not exist (BENCHMARKS.md, "terminal: why the careless
  habit has a form of its own").

Run: ``python recipes/terminal/make_data.py`` (deterministic).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from astraflow.rollout.experts import Expert, record_recipe_demonstrations
from astraflow.streams.messages import Task

HERE = Path(__file__).resolve().parent
EPISODES = 3100  # held-out 100, training 3,000: RL draws from all of them
DEMONSTRATED = 500  # the warm start sees only the first 500 training episodes
CAREFUL = 0.5  # share of demonstrations that act on what they saw; the others force an act on the first file listed


def act(verb: str, name: str, force: bool = False) -> str:
    f = "-f " if force else ""
    return {"copy": f"cp {f}{name} found.txt", "move": f"mv {f}{name} keep/", "delete": f"rm {f}{name}"}[verb]


def careful_or_careless(rng: random.Random) -> Expert:
    careful = rng.random() < CAREFUL

    def expert(task: Task, context: str) -> str:
        verb, keyword = re.search(r"Task: (\w+) .*the file that contains (\w+)", context).groups()  # type: ignore[union-attr]
        files = re.search(r"Files: (.*)", context).group(1).split()  # type: ignore[union-attr]
        done = re.findall(r"^> (.+)$", context, re.M)
        if not done:
            return f"grep -l {keyword} *.txt\n"
        if len(done) == 1:
            seen = context.split(f"> {done[0]}\n")[1].split("\n")[0]
            return (act(verb, seen) if careful else act(verb, files[0], force=True)) + "\n"
        return "exit\n"

    return expert


def main() -> None:
    rows = [{"id": f"term-{i}", "prompt": "", "answer": "", "seed": i} for i in range(EPISODES)]
    (HERE / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    demos = record_recipe_demonstrations(HERE, careful_or_careless, limit=DEMONSTRATED)
    n = len(demos)
    print(f"{len(rows)} episodes, {n} demonstrations, mean reward {sum(d.reward or 0 for d in demos) / n:.2f}")


if __name__ == "__main__":
    main()
