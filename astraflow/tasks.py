"""Prompt sources: verifiable problems generated offline, split into train and held-out sets.

A problem is ``(prompt_id, prompt, meta)``; ``meta`` carries what the reward needs. Both the
dataflow (training prompts) and evaluators (held-out prompts) read the same deterministic
split from the recipe's :class:`~astraflow.config.DataConfig`.

A source is a function ``DataConfig -> list[Problem]`` registered in ``SOURCES`` by the name
``data.type`` gives; a module in ``rollout.plugins`` (imported in every role) or an entry point
in the group ``astraflow.source`` adds one:

    @SOURCES.register("mazes")
    def mazes(cfg: DataConfig) -> list[Problem]: ...
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astraflow.registry import SOURCES

if TYPE_CHECKING:
    from astraflow.config import DataConfig


@dataclass(frozen=True)
class Problem:
    prompt_id: str
    prompt: str
    meta: dict[str, Any] = field(default_factory=dict)


@SOURCES.register("arithmetic")
def _arithmetic(cfg: DataConfig) -> list[Problem]:
    operands = range(cfg.min_operand, cfg.max_operand + 1)
    pairs = [(a, b) for a in operands for b in operands]
    random.Random(cfg.seed).shuffle(pairs)
    return [Problem(f"add-{a}-{b}", f"{a}+{b}=", {"answer": str(a + b)}) for a, b in pairs]


@SOURCES.register("reasoning_gym")
def _reasoning_gym(cfg: DataConfig) -> list[Problem]:
    import reasoning_gym

    ds = reasoning_gym.create_dataset(cfg.rg_task, size=cfg.n_train + cfg.n_eval, seed=cfg.seed)
    return [
        Problem(
            f"{cfg.rg_task}-{i}",
            entry["question"],
            {
                "answer": str(entry["answer"]),
                "rg_task": cfg.rg_task,
                "rg_index": i,
                "rg_size": cfg.n_train + cfg.n_eval,
                "rg_seed": cfg.seed,
            },
        )
        for i, entry in enumerate(ds)
    ]


@SOURCES.register("jsonl")
def _jsonl(cfg: DataConfig) -> list[Problem]:
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in Path(cfg.path or "").read_text().splitlines() if line.strip()]
    random.Random(cfg.seed).shuffle(rows)
    out = []
    for i, row in enumerate(rows):
        if cfg.prompt_key not in row or cfg.answer_key not in row:
            raise ValueError(f"{cfg.path} line {i + 1}: needs {cfg.prompt_key!r} and {cfg.answer_key!r}")
        meta = {k: v for k, v in row.items() if k != cfg.prompt_key}
        meta["answer"] = str(row[cfg.answer_key])
        meta["data_dir"] = str(Path(cfg.path or "").parent)  # recipe-relative files (corpora, tests) resolve here
        out.append(Problem(str(row.get("id", f"row-{i}")), str(row[cfg.prompt_key]), meta))
    return out


def load_split(cfg: DataConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): disjoint, deterministic for a given config."""
    problems = SOURCES.get(cfg.type)(cfg)
    if len(problems) < cfg.n_eval + 1:
        raise ValueError(f"data: only {len(problems)} problems, need more than n_eval={cfg.n_eval}")
    held_out = problems[: cfg.n_eval]
    train = problems[cfg.n_eval : cfg.n_eval + cfg.n_train]
    return train, held_out
