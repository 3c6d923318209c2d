"""Verifiable rewards, registered by name: ``reward(completion_text, meta) -> float``.

Each is a real verifier: exact integer match for generated arithmetic, math-verify for math
answers, reasoning-gym's own scorer for its tasks, tests run in a sandbox for code
(``code``), and exact match / token F1 for QA (``qa_em``, ``qa_f1``).
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
    """math-verify: parse the completion's final answer and check it against the reference.

    math-verify's own timeouts use ``signal.alarm``, which only works on the main thread; rollout
    nodes score inside a worker thread, so there the timeouts are off and the input is bounded
    instead (the last 4,000 characters hold the final answer).
    """
    import threading

    from math_verify import parse, verify

    on_main = threading.current_thread() is threading.main_thread()
    t = 5 if on_main else None
    gold = parse(f"${meta['answer']}$", parsing_timeout=t)
    pred = parse(text[-4000:], parsing_timeout=t)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=t) else 0.0


@lru_cache(maxsize=8)
def _rg_dataset(task: str, size: int, seed: int) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed)


@register("reasoning_gym")
def reasoning_gym_score(text: str, meta: dict[str, Any]) -> float:
    """reasoning-gym's own scorer for the entry the prompt came from."""
    ds = _rg_dataset(meta["rg_task"], int(meta["rg_size"]), int(meta["rg_seed"]))
    return float(ds.score_answer(text.strip(), ds[int(meta["rg_index"])]))


_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The last fenced code block of a completion, or the whole completion when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


@register("code")
def code(text: str, meta: dict[str, Any]) -> float:
    """Fraction of ``meta["tests"]`` (Python statements, usually asserts) the completion's code passes.

    The code runs in :mod:`astraflow.rollout.rewards.sandbox` (subprocess, time and memory limits, no
    network). ``meta`` may set ``timeout_s``, ``memory_mb`` and ``setup`` (code run before the candidate).
    """
    from astraflow.rollout.rewards.sandbox import Sandbox

    box = Sandbox(timeout_s=float(meta.get("timeout_s", 5.0)), cpu_s=int(meta.get("cpu_s", 5)), memory_mb=int(meta.get("memory_mb", 512)))
    src = (meta.get("setup", "") + "\n" + extract_code(text)).strip() + "\n"
    return _pass_fraction(box, src, tuple(meta["tests"]))


@lru_cache(maxsize=4096)
def _pass_fraction(box: Any, src: str, tests: tuple[str, ...]) -> float:
    """Programs and tests are deterministic, and the samples of a group often repeat one another: run each pair once."""
    return float(box.run(src, list(tests)).fraction)


def _normalize(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


_PUNCT = set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


def _golds(meta: dict[str, Any]) -> list[str]:
    golds = meta.get("answers") or [meta["answer"]]
    return [str(g) for g in golds]


@register("qa_em")
def qa_exact_match(text: str, meta: dict[str, Any]) -> float:
    """1 if the normalised completion equals a normalised reference (``meta["answers"]`` or ``meta["answer"]``)."""
    pred = _normalize(text)
    return 1.0 if any(pred == _normalize(g) for g in _golds(meta)) else 0.0


@register("qa_f1")
def qa_f1(text: str, meta: dict[str, Any]) -> float:
    """Best token-level F1 (SQuAD) between the normalised completion and a reference."""
    pred = _normalize(text).split()
    best = 0.0
    for g in _golds(meta):
        gold = _normalize(g).split()
        if not pred or not gold:
            best = max(best, float(pred == gold))
            continue
        common = sum(min(pred.count(w), gold.count(w)) for w in set(pred) & set(gold))
        if common:
            p, r = common / len(pred), common / len(gold)
            best = max(best, 2 * p * r / (p + r))
    return best
