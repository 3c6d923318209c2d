"""Verifiable rewards, registered by name: ``reward(completion_text, meta) -> float``.

Each is a real verifier: exact integer match for generated arithmetic, math-verify for math
answers, reasoning-gym's own scorer for its tasks, tests run in a sandbox for code
(``code``), and exact match / token F1 for QA (``qa_em``, ``qa_f1``).

Rewards live in the reward registry (``REWARDS.register(name)``); a plug-in module in
``rollout.plugins`` or an entry point in the group ``astraflow.reward`` adds more.

A reward states the range of its values (``@reward_range(low, high)``; every built-in one is
``[0, 1]``); one that states none gets ``registry.DEFAULT_REWARD_RANGE``, ``[-1, 1]``. A reward that is costly to
compute (tests run in a sandbox) says so (``@costly``). The dataflow reads both: it refuses a
claimed reward outside the range, and scores again every trajectory of a cheap reward and a sample
(``dataflow.rescore_costly``) of a costly one (``dataflow/claims.py``).

A reward may also say what its ``meta`` must hold (``@checks_meta(check)``): a check
returns why a task's meta cannot be scored (no reference answer, tests that do not parse,
sandbox limits out of range), or None. Rollout nodes ask it before they play a task
(:func:`meta_problem`, ``rollout/task_checks.py``), so a task the reward would crash on is
dead-lettered with that reason instead of failing its workflow again and again.
"""

from __future__ import annotations

import math as _math
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any, TypeVar

from astraflow.registry import DEFAULT_REWARD_RANGE, REWARDS, UnknownName

Reward = Callable[[str, dict[str, Any]], float]
MetaCheck = Callable[[dict[str, Any]], str | None]  # why ``meta`` cannot be scored, or None
R = TypeVar("R", bound=Reward)
_INT = re.compile(r"^\s*(-?\d+)\s*$")
MAX_ANSWER_CHARS = 2_000  # a reference answer longer than this is not one (int() refuses > 4300 digits; parsers slow down)


def checks_meta(check: MetaCheck) -> Callable[[R], R]:
    """Decorator: attach to a reward the check of the ``meta`` it can score (``meta_check``, asked by :func:`meta_problem`)."""

    def deco(reward: R) -> R:
        reward.meta_check = check  # type: ignore[attr-defined]
        return reward

    return deco


def reward_range(low: float, high: float) -> Callable[[R], R]:
    """Decorator: the reward's values lie in ``[low, high]`` (read by :func:`range_of`)."""
    if not low <= high:
        raise ValueError(f"reward_range({low}, {high}): low must not exceed high")

    def deco(reward: R) -> R:
        reward.value_range = (float(low), float(high))  # type: ignore[attr-defined]
        return reward

    return deco


def costly(reward: R) -> R:
    """Decorator: scoring runs something expensive (tests in a sandbox): the dataflow scores a sample of it again."""
    reward.costly = True  # type: ignore[attr-defined]
    return reward


def range_of(reward: Reward) -> tuple[float, float]:
    """The range the reward states, or ``DEFAULT_REWARD_RANGE``."""
    return getattr(reward, "value_range", DEFAULT_REWARD_RANGE)


def is_costly(reward: Reward) -> bool:
    return bool(getattr(reward, "costly", False))


def meta_problem(name: str, meta: dict[str, Any]) -> str | None:
    """Why the reward ``name`` cannot score a task with ``meta`` (its check), or None (no check, or no such reward: trusted)."""
    try:
        check: MetaCheck | None = getattr(REWARDS.get(name), "meta_check", None)
    except UnknownName:
        return None
    if check is None:
        return None
    try:
        return check(meta)
    except Exception as e:  # a check that trips over the meta has found a problem with it
        return f"{type(e).__name__}: {e}"


def _answer(meta: dict[str, Any], key: str = "answer") -> str | None:
    """The reference answer as a string the reward can read, or a problem."""
    if key not in meta:
        return f"no {key!r} in meta"
    a = meta[key]
    if not isinstance(a, (str, int)) or isinstance(a, bool):
        return f"meta[{key!r}] is a {type(a).__name__}, not a string"
    if len(str(a)) > MAX_ANSWER_CHARS:
        return f"meta[{key!r}] has {len(str(a))} characters (at most {MAX_ANSWER_CHARS})"
    return None


def _integer_answer(meta: dict[str, Any]) -> str | None:
    problem = _answer(meta)
    if problem is None and not _INT.match(str(meta["answer"])):
        return f"meta['answer'] {str(meta['answer'])[:40]!r} is not an integer"
    return problem


def get_reward(name: str) -> Reward:
    return REWARDS.get(name)



@REWARDS.register("arithmetic")
@reward_range(0.0, 1.0)
@checks_meta(_integer_answer)
def arithmetic(text: str, meta: dict[str, Any]) -> float:
    """1 if the completion is exactly the integer answer (whitespace aside), else 0."""
    m = _INT.match(text)
    return 1.0 if m and int(m.group(1)) == int(meta["answer"]) else 0.0


@REWARDS.register("math")
@reward_range(0.0, 1.0)
@checks_meta(_answer)
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


MAX_RG_SIZE = 1_000_000  # reasoning-gym builds the whole dataset to score one entry: bound it


def _rg_meta(meta: dict[str, Any]) -> str | None:
    if not isinstance(meta.get("rg_task"), str) or not meta["rg_task"]:
        return "meta['rg_task'] is not a dataset name"
    bad = [k for k in ("rg_size", "rg_seed", "rg_index") if not isinstance(meta.get(k), int) or isinstance(meta.get(k), bool)]
    if bad:
        return f"meta {bad} are not integers"
    size, index = int(meta["rg_size"]), int(meta["rg_index"])
    if not 0 < size <= MAX_RG_SIZE or not 0 <= index < size:
        return f"rg_index {index} of a dataset of {size} (at most {MAX_RG_SIZE})"
    return None


@lru_cache(maxsize=8)
def _rg_dataset(task: str, size: int, seed: int) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed)


@REWARDS.register("reasoning_gym")
@reward_range(0.0, 1.0)
@checks_meta(_rg_meta)
def reasoning_gym_score(text: str, meta: dict[str, Any]) -> float:
    """reasoning-gym's own scorer for the entry the prompt came from."""
    ds = _rg_dataset(meta["rg_task"], int(meta["rg_size"]), int(meta["rg_seed"]))
    return float(ds.score_answer(text.strip(), ds[int(meta["rg_index"])]))


_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The last fenced code block of a completion, or the whole completion when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


MAX_TESTS = 256
MAX_TEST_CHARS = 20_000
SANDBOX_LIMITS = {"timeout_s": (0.0, 600.0), "cpu_s": (0.0, 600.0), "memory_mb": (16.0, 65_536.0)}  # (above, at most)


def _parses(src: str, what: str) -> str | None:
    try:
        compile(src, f"<{what}>", "exec")
    except (SyntaxError, ValueError) as e:  # ValueError: a NUL byte
        return f"{what} does not parse: {e}"
    return None


def _code_meta(meta: dict[str, Any]) -> str | None:
    tests = meta.get("tests")
    if not isinstance(tests, list) or not tests or len(tests) > MAX_TESTS:
        return f"meta['tests'] must be a list of 1 to {MAX_TESTS} Python statements"
    for i, t in enumerate(tests):
        if not isinstance(t, str) or len(t) > MAX_TEST_CHARS:
            return f"meta['tests'][{i}] is not a statement of at most {MAX_TEST_CHARS} characters"
        if (problem := _parses(t, f"meta['tests'][{i}]")) is not None:
            return problem
    for key in ("setup", "reference"):  # code run before the candidate; the solution test generators are checked on
        if key not in meta:
            continue
        if not isinstance(meta[key], str):
            return f"meta[{key!r}] is a {type(meta[key]).__name__}, not source code"
        if (problem := _parses(meta[key], f"meta[{key!r}]")) is not None:
            return problem
    for key, (low, high) in SANDBOX_LIMITS.items():
        if key in meta:
            v = meta[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not _math.isfinite(v) or not low < v <= high:
                return f"meta[{key!r}] = {v!r}: a number in ({low:g}, {high:g}]"
    return None


@REWARDS.register("code")
@reward_range(0.0, 1.0)
@costly
@checks_meta(_code_meta)
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


def _qa_meta(meta: dict[str, Any]) -> str | None:
    golds = meta.get("answers")
    if golds:
        if not isinstance(golds, list) or not all(isinstance(g, (str, int)) and not isinstance(g, bool) for g in golds):
            return "meta['answers'] is not a list of strings"
        longest = max(len(str(g)) for g in golds)
        return None if longest <= MAX_ANSWER_CHARS else f"a reference answer of {longest} characters (at most {MAX_ANSWER_CHARS})"
    return _answer(meta)


@REWARDS.register("qa_em")
@reward_range(0.0, 1.0)
@checks_meta(_qa_meta)
def qa_exact_match(text: str, meta: dict[str, Any]) -> float:
    """1 if the normalised completion equals a normalised reference (``meta["answers"]`` or ``meta["answer"]``)."""
    pred = _normalize(text)
    return 1.0 if any(pred == _normalize(g) for g in _golds(meta)) else 0.0


@REWARDS.register("qa_f1")
@reward_range(0.0, 1.0)
@checks_meta(_qa_meta)
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
