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

Where the cores go (``trainer.cores``): on a CPU-only machine ``up`` gives each trainer on ``auto`` its ``threads``
cores of its own (the last ones), when the cores left over still hold every node's ``rollout.threads``; every other
role runs on those left over (``shared_cores``). A trainer pins itself once its warm start is done (``pin``); the
other roles start on every core and move to those left once started (``Role.started``, ``--cores``).

A trainer's work off the training path (its checkpoint writes: ``train/group_commit.py``) runs on a thread of its own
(``background_executor``), on the cores it does not train on when it has cores of its own, so its CPU is not taken
from the step's. It keeps the trainer's priority there, above the nodes (nice 10 under ``up``): it holds the GIL the
step needs for moments (a file's header, the return of each write), and a thread the scheduler had put behind a busy
node while it held the GIL stalled the step until the node yielded. At nice 19 a write was in flight 90-160 ms
instead of about 20, and in ``up`` the step after a checkpoint was 16-30 ms slower than the others instead of 5-14
(BENCHMARKS.md, "The checkpoint writer off the trainer's core").
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from astraflow.config import Recipe

log = logging.getLogger(__name__)
LOWEST_PRIORITY = 19  # nice: the scheduler gives such a thread the cores others leave, and a small share when none do


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def usable_core_ids() -> list[int]:
    """The CPUs this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return list(range(os.cpu_count() or 1))


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


def with_core_plan(recipe: Recipe, cores: list[int], accelerator: bool) -> Recipe:
    """``recipe`` with every ``trainer.cores: auto`` resolved for ``up`` on ``cores`` (after ``with_thread_counts``):
    its ``threads`` cores of its own, taken from the end of ``cores`` past those listed by hand, when none trains on
    an accelerator, the cores left hold every node's threads and the platform pins threads (Linux); else ``shared``."""
    auto = [p for p, cfg in recipe.policies.items() if cfg.trainer.cores == "auto"]
    if not auto:
        return recipe
    taken = {c for cfg in recipe.policies.values() if isinstance(cfg.trainer.cores, list) for c in cfg.trainer.cores}
    free = [c for c in cores if c not in taken]
    wanted = sum(int(recipe.policies[p].trainer.threads) for p in auto)  # ints after with_thread_counts
    nodes = recipe.rollout.threads * recipe.rollout.nodes
    room = hasattr(os, "sched_setaffinity") and not accelerator and len(free) - wanted >= max(1, nodes)
    policies = {}
    for p, cfg in recipe.policies.items():
        if p in auto:
            mine: list[int] | str = "shared"
            if room:
                n = int(cfg.trainer.threads)
                mine, free = free[len(free) - n:], free[:len(free) - n]
            cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"cores": mine})})
        policies[p] = cfg
    return recipe.model_copy(update={"policies": policies})


def shared_cores(recipe: Recipe, cores: list[int]) -> tuple[int, ...] | None:
    """The cores every role but the trainers runs on under ``up``: ``cores`` less those trainers hold as their own
    (None: no trainer holds any, none would be left, or the platform cannot pin; nothing is pinned)."""
    held = {c for cfg in recipe.policies.values() if isinstance(cfg.trainer.cores, list) for c in cfg.trainer.cores}
    rest = [c for c in cores if c not in held]
    return tuple(rest) if held and rest and hasattr(os, "sched_setaffinity") else None


def pin(cores: Sequence[int]) -> bool:
    """Run every thread of this process, and those it starts later (they inherit it), on ``cores``. False where
    the platform has no CPU affinity."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    before = os.sched_getaffinity(0)
    try:  # this thread first: the kernel drops CPUs it does not offer (and refuses a set of none)
        os.sched_setaffinity(0, cores)
    except OSError as e:
        raise ValueError(f"cannot run on CPUs {cores}: {e}") from None
    if (got := os.sched_getaffinity(0)) != set(cores):
        os.sched_setaffinity(0, before)
        raise ValueError(f"cannot run on CPUs {sorted(set(cores) - got)} of {cores}: this machine does not offer them")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return True


def pin_group(pgid: int, cores: Sequence[int]) -> int:
    """Run every thread of every process in process group ``pgid`` (a role and what it started) on ``cores``, from
    another process: a role pins itself (``pin``) and ``up`` widens the evaluator's cores when the trainers are done.
    Best effort: a process or thread that ends meanwhile, or refuses (another user's), is skipped; how many threads
    were moved (0 without CPU affinity)."""
    if not hasattr(os, "sched_setaffinity"):
        return 0
    moved = 0
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]  # the fields after the name
            if int(pgrp) != pgid or state == "Z":  # another group's, or ended and not yet reaped
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), cores)
                moved += 1
        except OSError:  # ended meanwhile, or not ours to move
            continue
    return moved


def threads_for(threads: int | str) -> int:
    """A trainer's torch threads: the configured count, or on ``auto`` (a trainer on its own) the usable cores shared
    by the ranks of a data-parallel group on this machine (``LOCAL_WORLD_SIZE``, set by torchrun)."""
    if threads != "auto":
        return int(threads)
    return max(1, usable_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def spare_cores(own: Sequence[int]) -> list[int]:
    """The cores this process may run on but does not train on (``own``); call it before :func:`pin`."""
    return [c for c in usable_core_ids() if c not in set(own)]


def background_executor(cores: Sequence[int] | None, name: str, priority: int | None = None) -> ThreadPoolExecutor:
    """One thread for work off the training path, on ``cores`` (None or empty: wherever this process runs), at the
    process's priority or at nice ``priority`` when it is lower (``LOWEST_PRIORITY``: a benchmark's comparison). On
    Linux, which keeps both per thread; elsewhere a plain thread."""
    def setup() -> None:
        me = threading.get_native_id()  # Linux takes a thread's id where it asks for a process's: this thread alone
        try:
            if priority is not None and priority > os.getpriority(os.PRIO_PROCESS, me):  # lowered only
                os.setpriority(os.PRIO_PROCESS, me, priority)
            if cores:
                os.sched_setaffinity(me, cores)
        except OSError as e:  # a core taken away since: it runs where the trainer does
            log.warning("%s: cannot run on CPUs %s (%s)", name, list(cores or []), e)

    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=setup if sys.platform.startswith("linux") else None)
