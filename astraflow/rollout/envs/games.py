"""Tiny text games with the shape of ALFWorld (household tasks), WebShop (shopping) and Terminal-Bench (a shell).

Each game is deterministic given its seed: ``reset() -> observation`` then
``step(action) -> (observation, reward, done)``, and ``close()`` when the episode is over. Rewards:
``rooms`` pays 1 when the goal object is put in the goal receptacle (putting another object there
ends the task unpaid); ``shop`` pays the fraction of
wanted attributes the bought product has; ``terminal`` (``terminal.py``) pays 1 when the final
state of its scratch directory passes the task's check. Unknown actions cost a step and say which
actions exist.

Games live in the environment registry (``ENVIRONMENTS``, ``game(seed) -> Game``); a plug-in module in
``rollout.plugins`` or an entry point in the group ``astraflow.environment`` adds more.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Protocol

from astraflow.registry import Registry
from astraflow.rollout.envs.terminal import Terminal


class Game(Protocol):
    def reset(self) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool]: ...

    def close(self) -> None:
        """Release what the episode holds (a scratch directory); the episode is over."""


ENVIRONMENTS: Registry[Callable[[int], Game]] = Registry("environment", "astraflow.rollout.envs.games", plugins="rollout.plugins")


@ENVIRONMENTS.register("rooms")
class Rooms:
    """ALFWorld-like: find an object in some room and put it in a receptacle."""

    ROOMS = ("kitchen", "hall", "bedroom")
    OBJECTS = ("apple", "mug", "book", "key")
    RECEPTACLES = {"kitchen": "fridge", "hall": "shelf", "bedroom": "drawer"}

    def __init__(self, seed: int, max_steps: int = 12) -> None:
        rng = random.Random(seed)
        self.where = {o: rng.choice(self.ROOMS) for o in self.OBJECTS}
        self.goal_obj = rng.choice(self.OBJECTS)
        self.goal_room = rng.choice([r for r in self.ROOMS if r != self.where[self.goal_obj]])
        self.goal_rec = self.RECEPTACLES[self.goal_room]
        self.room = "hall"
        self.holding: str | None = None
        self.steps, self.max_steps = 0, max_steps

    def _look(self) -> str:
        here = [o for o, r in self.where.items() if r == self.room]
        return f"You are in the {self.room}. You see: {', '.join(here) or 'nothing'}; a {self.RECEPTACLES[self.room]}."

    def reset(self) -> str:
        return (f"Your task: put the {self.goal_obj} in the {self.goal_rec}. "
                f"Actions: go to ROOM, take OBJ, put OBJ in REC, look. Rooms: {', '.join(self.ROOMS)}. " + self._look())

    def step(self, action: str) -> tuple[str, float, bool]:
        self.steps += 1
        a = action.strip().lower().rstrip(".")
        out, reward, done = "Nothing happens.", 0.0, False
        if m := re.fullmatch(r"go to (?:the )?(\w+)", a):
            if m.group(1) in self.ROOMS:
                self.room = m.group(1)
                out = self._look()
        elif m := re.fullmatch(r"take (?:the )?(\w+)", a):
            obj = m.group(1)
            if self.holding is None and self.where.get(obj) == self.room:
                self.holding, self.where[obj] = obj, "hand"
                out = f"You take the {obj}."
        elif m := re.fullmatch(r"put (?:the )?(\w+) in (?:the )?(\w+)", a):
            obj, rec = m.groups()
            if self.holding == obj and rec == self.RECEPTACLES[self.room]:
                self.holding, self.where[obj] = None, self.room
                out = f"You put the {obj} in the {rec}."
                if rec == self.goal_rec:  # whatever goes into the task's receptacle ends the task
                    ok = obj == self.goal_obj
                    out, reward, done = out + (" Task complete." if ok else " Wrong object: task failed."), float(ok), True
        elif a == "look":
            out = self._look()
        else:
            out = "Unknown action. Actions: go to ROOM, take OBJ, put OBJ in REC, look."
        if not done and self.steps >= self.max_steps:
            out, done = out + " Out of steps.", True
        return out, reward, done

    def close(self) -> None:
        pass


@ENVIRONMENTS.register("shop")
class Shop:
    """WebShop-like: search a catalogue, open an item, buy the one that fits the instruction."""

    COLORS = ("red", "blue", "black")
    KINDS = ("shirt", "mug", "lamp")
    SIZES = ("small", "large")

    def __init__(self, seed: int, max_steps: int = 8) -> None:
        rng = random.Random(seed)
        combos = [(k, c, s) for k in self.KINDS for c in self.COLORS for s in self.SIZES]
        rng.shuffle(combos)  # ids say nothing about an item: the agent has to read the results
        self.items = [{"id": f"i{n}", "kind": k, "color": c, "size": s, "price": rng.randint(5, 50)} for n, (k, c, s) in enumerate(combos)]
        self.want = {"kind": rng.choice(self.KINDS), "color": rng.choice(self.COLORS), "size": rng.choice(self.SIZES)}
        self.page: list[dict] = []
        self.open: dict | None = None
        self.steps, self.max_steps = 0, max_steps

    def reset(self) -> str:
        w = self.want
        return f"Instruction: buy a {w['size']} {w['color']} {w['kind']}. Actions: search[words], click[ID], buy."

    @staticmethod
    def _show(item: dict) -> str:
        return f"{item['id']}: {item['size']} {item['color']} {item['kind']} ${item['price']}"

    def step(self, action: str) -> tuple[str, float, bool]:
        self.steps += 1
        a = action.strip().lower()
        out, reward, done = "Unknown action. Actions: search[words], click[ID], buy.", 0.0, False
        if m := re.fullmatch(r"search\[(.*)\]", a):
            words = set(m.group(1).split())
            self.page = sorted(self.items, key=lambda it: (-len(words & {it["kind"], it["color"], it["size"]}), it["id"]))[:3]
            out = "Results: " + "; ".join(self._show(it) for it in self.page)
        elif m := re.fullmatch(r"click\[(\w+)\]", a):
            found = [it for it in self.page if it["id"] == m.group(1)]
            if found:
                self.open = found[0]
                out = "Item " + self._show(self.open) + ". Actions: buy, search[words]."
            else:
                out = "No such item on this page."
        elif a == "buy":
            if self.open is None:
                out = "Open an item first."
            else:
                reward = sum(self.open[k] == v for k, v in self.want.items()) / len(self.want)
                out, done = f"You bought {self._show(self.open)}.", True
        if not done and self.steps >= self.max_steps:
            out, done = out + " Out of steps.", True
        return out, reward, done

    def close(self) -> None:
        pass


ENVIRONMENTS.register("terminal")(Terminal)
