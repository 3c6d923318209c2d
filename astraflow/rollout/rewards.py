"""Verifiable rewards, registered by name: ``reward(completion_text, meta) -> float``.

Each is a real verifier: exact integer match for generated arithmetic, math-verify for math
answers, and reasoning-gym's own scorer for its tasks.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Callable

Reward = Callable[[str, dict[str, Any]], float]
REWARDS: dict[str, Reward] = {}


def register(name: str) -> Callable[[Reward], Reward]:
    def deco(fn: Reward) -> Reward:
        REWARDS[name] = fn
        return fn

    return deco


def get_reward(name: str) -> Reward:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; registered: {sorted(REWARDS)}") from None


_INT = re.compile(r"^\s*(-?\d+)\s*$")


@register("arithmetic")
def arithmetic(text: str, meta: dict[str, Any]) -> float:
    """1 if the completion is exactly the integer answer (whitespace aside), else 0."""
    m = _INT.match(text)
    return 1.0 if m and int(m.group(1)) == int(meta["answer"]) else 0.0


@register("math")
def math(text: str, meta: dict[str, Any]) -> float:
    """math-verify: parse the completion's final answer and check it against the reference."""
    from math_verify import parse, verify

    gold = parse(f"${meta['answer']}$")
    pred = parse(text)
    return 1.0 if pred and verify(gold, pred) else 0.0


@lru_cache(maxsize=8)
def _rg_dataset(task: str, size: int, seed: int) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed)


@register("reasoning_gym")
def reasoning_gym_score(text: str, meta: dict[str, Any]) -> float:
    """reasoning-gym's own scorer for the entry the prompt came from."""
    ds = _rg_dataset(meta["rg_task"], int(meta["rg_size"]), int(meta["rg_seed"]))
    return float(ds.score_answer(text.strip(), ds[int(meta["rg_index"])]))
