"""``terminal``: a Terminal-Bench-style game. Shell commands in a scratch directory; the final state is checked.

Each seed makes a scratch directory with three text files, one of which holds a keyword, and a task
about that file: copy it to ``found.txt``, move it into ``keep/``, or delete it. The observation
names the task and the files but not which file holds the keyword: the agent has to look
(``grep -l WORD *``) and read the answer from the command's output.

Every action is a command line run by the restricted shell (``shell.py``: allowed programs only,
paths confined to the scratch directory, each command in the sandbox). ``exit`` ends the episode;
so does the step limit. Then the checker reads the directory: reward 1 when the task is done and
no other file was lost or changed, else 0. There is no reward before the end.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

from astraflow.rollout.envs.shell import run_command
from astraflow.rollout.rewards.sandbox import Sandbox

VERBS = ("copy", "move", "delete")
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"


def word(rng: random.Random, n: int) -> str:
    """A made-up pronounceable lowercase word of ``n`` letters."""
    return "".join(rng.choice(CONSONANTS if i % 2 == 0 else VOWELS) for i in range(n))


class Terminal:
    """One task in its own scratch directory (removed by ``close``)."""

    def __init__(self, seed: int, max_steps: int = 4, sandbox: Sandbox | None = None) -> None:
        rng = random.Random(seed)
        self.keyword = word(rng, 4).upper()
        names: list[str] = []
        while len(names) < 3:
            name = f"{word(rng, 4)}.txt"
            if name not in names:
                names.append(name)
        self.verb = rng.choice(VERBS)
        self.target = rng.choice(names)
        self.files = {n: " ".join(word(rng, 4) for _ in range(3)) + "\n" for n in names}
        self.files[self.target] = f"{word(rng, 4)} {self.keyword} {word(rng, 4)}\n"
        self.root = Path(tempfile.mkdtemp(prefix="af-terminal-"))
        for name, text in self.files.items():
            (self.root / name).write_text(text)
        (self.root / "keep").mkdir()
        self.sandbox = sandbox or Sandbox(timeout_s=5.0, cpu_s=2, memory_mb=256, file_mb=1)
        self.steps, self.max_steps = 0, max_steps

    def instruction(self) -> str:
        where = {"copy": " to found.txt", "move": " into keep/", "delete": ""}[self.verb]
        return f"{self.verb}{where} the file that contains {self.keyword}"

    def reset(self) -> str:
        return f"Task: {self.instruction()}. Then exit.\nFiles: {' '.join(self.files)}"

    def step(self, action: str) -> tuple[str, float, bool]:
        self.steps += 1
        line = action.strip()
        if line == "exit":
            return self._finish("")
        out = run_command(line, self.root, self.sandbox)
        if self.steps >= self.max_steps:
            return self._finish(out + "\nout of steps")
        return out, 0.0, False

    def _finish(self, out: str) -> tuple[str, float, bool]:
        done = self.check()
        return f"{out.strip()}\n{'task done' if done else 'task not done'}".strip(), float(done), True

    def check(self) -> bool:
        """The task is done and every other file is still in place, unchanged."""
        others = all(self._holds(self.root / n, t) for n, t in self.files.items() if n != self.target)
        at_root = self._holds(self.root / self.target, self.files[self.target])
        if self.verb == "copy":
            return others and at_root and self._holds(self.root / "found.txt", self.files[self.target])
        if self.verb == "move":
            return others and not (self.root / self.target).exists() and self._holds(self.root / "keep" / self.target,
                                                                                     self.files[self.target])
        return others and not (self.root / self.target).exists()

    @staticmethod
    def _holds(path: Path, text: str) -> bool:
        return path.is_file() and not path.is_symlink() and path.read_text(errors="replace") == text

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
