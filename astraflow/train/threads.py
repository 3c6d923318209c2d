"""How many torch threads a trainer takes: ``trainer.threads``, or with ``auto`` the cores this process may run on
that the other roles on the machine leave free.

``astraflow up`` runs every role on one machine: ``rollout.nodes`` nodes and the evaluator take ``rollout.threads``
each (the dataflow waits on the plane and is not counted), and the trainers share the rest:

    threads(policy) = max(1, (cores − rollout.threads · (nodes + evaluator)) // trainers on auto)

with ``cores`` = ``len(os.sched_getaffinity(0))`` (a container's or ``taskset``'s limit, not the machine's count).
The warm start (``sft.threads: auto``) runs before version 0, while every other role waits for it, so the trainers
that warm-start share all the cores: ``max(1, cores // trainers warm-starting)``.
``up`` writes the numbers into the run's ``recipe.yaml``, so a restarted trainer runs with the same count (its
floating-point sums, and so its resumed weights, depend on it). A trainer started alone (``astraflow worker
trainer``) takes every core it may run on.
"""

from __future__ import annotations

import os

from astraflow.config import Recipe


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def trainer_threads(recipe: Recipe, cores: int) -> dict[str, int]:
    """Threads of each trainer on ``auto`` when every role of ``recipe`` shares ``cores`` (``astraflow up``)."""
    auto = [p for p, cfg in recipe.policies.items() if cfg.trainer.threads == "auto"]
    if not auto:
        return {}
    others = recipe.rollout.threads * (recipe.rollout.nodes + (1 if recipe.eval.enabled else 0))
    fixed = sum(int(cfg.trainer.threads) for cfg in recipe.policies.values() if cfg.trainer.threads != "auto")
    free = max(1, (cores - others - fixed) // len(auto))
    return {p: free for p in auto}


def sft_threads(recipe: Recipe, cores: int) -> dict[str, int]:
    """Threads of each warm start on ``auto`` when every role of ``recipe`` shares ``cores``: all of them, split
    between the trainers that warm-start (nothing else runs before version 0)."""
    warm = [p for p, cfg in recipe.policies.items() if cfg.sft.steps]
    return {p: max(1, cores // len(warm)) for p in warm if recipe.policies[p].sft.threads == "auto"}


def with_thread_counts(recipe: Recipe, cores: int) -> Recipe:
    """``recipe`` with every ``trainer.threads`` and ``sft.threads`` on ``auto`` replaced by its share of ``cores``
    (what ``up`` runs)."""
    train, warm = trainer_threads(recipe, cores), sft_threads(recipe, cores)
    policies = {}
    for p, cfg in recipe.policies.items():
        if p in train:
            cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"threads": train[p]})})
        if p in warm:
            cfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"threads": warm[p]})})
        policies[p] = cfg
    return recipe.model_copy(update={"policies": policies})


def threads_for(threads: int | str) -> int:
    """A trainer's torch threads: the configured count, or on ``auto`` (a trainer on its own) the usable cores shared
    by the ranks of a data-parallel group on this machine (``LOCAL_WORLD_SIZE``, set by torchrun)."""
    if threads != "auto":
        return int(threads)
    return max(1, usable_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
