"""trainer.threads: auto takes the cores the other roles of ``astraflow up`` leave free; sft.threads: auto takes them all;
trainer.cores: auto gives a CPU trainer those cores as its own, and the other roles run on the rest."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from astraflow.config import parse_recipe
from astraflow.train.threads import (
    LOWEST_PRIORITY,
    background_executor,
    pin,
    pin_group,
    sft_threads,
    shared_cores,
    spare_cores,
    threads_for,
    trainer_threads,
    usable_core_ids,
    usable_cores,
    with_core_plan,
    with_thread_counts,
)


def test_auto_shares_what_the_nodes_and_the_evaluator_leave():
    recipe = parse_recipe({"name": "t", "rollout": {"nodes": 2, "threads": 2}})  # evaluator on by default
    assert trainer_threads(recipe, cores=16) == {"solver": 16 - 3 * 2}
    assert trainer_threads(recipe, cores=4) == {"solver": 1}  # never below one
    two = parse_recipe({"name": "t", "policies": ["solver", "verifier"], "rollout": {"nodes": 1}, "eval": {"enabled": False}})
    assert trainer_threads(two, cores=9) == {"solver": 4, "verifier": 4}


def test_a_fixed_count_is_kept_and_counted():
    recipe = parse_recipe({"name": "t", "policies": {"solver": {}, "verifier": {"trainer": {"threads": 3}}}, "rollout": {"nodes": 1},
                           "eval": {"enabled": False}})
    resolved = with_thread_counts(recipe, cores=8)
    assert resolved.policies["verifier"].trainer.threads == 3
    assert resolved.policies["solver"].trainer.threads == 8 - 1 - 3


def test_the_warm_starts_share_every_core_before_version_0():
    recipe = parse_recipe({"name": "t", "policies": {"solver": {"sft": {"steps": 5}}, "verifier": {"sft": {"steps": 5}}, "critic": {}},
                           "rollout": {"nodes": 2}})
    assert sft_threads(recipe, cores=9) == {"solver": 4, "verifier": 4}  # the critic does not warm-start
    resolved = with_thread_counts(recipe, cores=2)
    assert resolved.policies["solver"].sft.threads == 1 and resolved.policies["solver"].trainer.threads == 1
    one = with_thread_counts(parse_recipe({"name": "t", "sft": {"steps": 5}, "rollout": {"nodes": 2}}), cores=2)
    assert one.policies["solver"].sft.threads == 2 and one.policies["solver"].trainer.threads == 1
    fixed = parse_recipe({"name": "t", "sft": {"steps": 5, "threads": 3}})
    assert with_thread_counts(fixed, cores=8).policies["solver"].sft.threads == 3


def test_alone_a_trainer_takes_its_usable_cores(monkeypatch: pytest.MonkeyPatch):
    assert threads_for(5) == 5
    assert threads_for("auto") == usable_cores()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(usable_cores() * 4))
    assert threads_for("auto") == 1


def test_a_bad_count_fails_at_load_with_the_field_named():
    with pytest.raises(ValueError, match="threads"):
        parse_recipe({"name": "t", "trainer": {"threads": 0}})
    with pytest.raises(ValueError, match="threads"):
        parse_recipe({"name": "t", "sft": {"threads": 0}})


def plan(spec: dict, cores: list[int], accelerator: bool = False) -> dict[str, object]:
    recipe = with_core_plan(with_thread_counts(parse_recipe({"name": "t", **spec}), len(cores)), cores, accelerator)
    shared = shared_cores(recipe, cores)
    return {p: cfg.trainer.cores for p, cfg in recipe.policies.items()} | {"shared": None if shared is None else list(shared)}


def test_a_cpu_trainer_gets_cores_of_its_own_and_the_other_roles_the_rest():
    assert plan({"rollout": {"nodes": 1}}, [0, 1]) == {"solver": [1], "shared": [0]}  # 1 thread: the node and the rest on CPU 0
    assert plan({"rollout": {"nodes": 2}, "eval": {"enabled": False}}, list(range(8))) == {"solver": [2, 3, 4, 5, 6, 7], "shared": [0, 1]}
    two = plan({"policies": ["solver", "verifier"], "rollout": {"nodes": 1}, "eval": {"enabled": False}}, [4, 5, 6, 7, 8, 9, 10])
    assert two == {"solver": [8, 9, 10], "verifier": [5, 6, 7], "shared": [4]}  # (7 - 1 node) // 2 threads each


def test_no_core_of_its_own_where_the_nodes_would_not_fit_or_the_step_runs_on_an_accelerator():
    assert plan({"rollout": {"nodes": 2}}, [0, 1]) == {"solver": "shared", "shared": None}  # two nodes on one core: no
    assert plan({"rollout": {"nodes": 1}}, [0]) == {"solver": "shared", "shared": None}
    assert plan({"rollout": {"nodes": 1}}, list(range(16)), accelerator=True) == {"solver": "shared", "shared": None}
    assert plan({"rollout": {"nodes": 1}, "trainer": {"cores": "shared"}}, [0, 1]) == {"solver": "shared", "shared": None}


def test_nothing_is_pinned_where_the_platform_cannot_pin(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)  # macOS
    assert plan({"rollout": {"nodes": 1}}, [0, 1, 2, 3]) == {"solver": "shared", "shared": None}
    assert plan({"rollout": {"nodes": 1}, "trainer": {"cores": [3]}}, [0, 1, 2, 3]) == {"solver": [3], "shared": None}
    assert pin([0]) is False


def test_cores_listed_by_hand_are_kept_and_kept_from_the_other_roles():
    listed = plan({"policies": {"solver": {"trainer": {"cores": [0]}}, "verifier": {}}, "rollout": {"nodes": 1},
                   "eval": {"enabled": False}}, [0, 1, 2, 3])
    assert listed["solver"] == [0] and listed["verifier"] == [3] and listed["shared"] == [1, 2]


def test_bad_cores_fail_at_load_or_at_the_pin_with_the_field_named():
    for bad in ([], [1, 1], [-1], "all"):
        with pytest.raises(ValueError, match="cores"):
            parse_recipe({"name": "t", "trainer": {"cores": bad}})
    before = usable_core_ids()
    for bad in ([4096], [before[0], 4096]):  # no such CPU: nothing changes
        with pytest.raises(ValueError, match="cannot run on CPUs"):
            pin(bad)
        assert usable_core_ids() == before


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_pin_moves_every_thread_and_the_threads_started_later():
    before = usable_core_ids()
    ready, done = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def early() -> None:
        ready.set()
        done.wait(10)
        seen["early"] = os.sched_getaffinity(0)

    t = threading.Thread(target=early)
    t.start()
    ready.wait(10)
    try:
        assert pin([before[-1]])
        late = threading.Thread(target=lambda: seen.setdefault("late", os.sched_getaffinity(0)))
        late.start()
        late.join(10)
        done.set()
        t.join(10)
        assert seen == {"early": {before[-1]}, "late": {before[-1]}} and os.sched_getaffinity(0) == {before[-1]}
    finally:
        done.set()
        pin(before)
    assert usable_core_ids() == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority and affinity are Linux's")
def test_the_background_thread_runs_on_the_spare_cores_at_the_trainers_priority_and_the_trainer_keeps_its_own():
    """A pinned trainer's checkpoint writes run on the cores it does not train on, at the trainer's priority (a thread
    behind the nodes there would stall the step while it held the GIL); lowered only when asked. The trainer's own
    threads keep their priority and cores."""
    before, nice = usable_core_ids(), os.getpriority(os.PRIO_PROCESS, 0)
    spare = spare_cores(before[-1:])
    assert spare == before[:-1]
    writer, lowered = background_executor(spare, "checkpoint-writer"), background_executor(spare, "lowered", LOWEST_PRIORITY)
    try:
        assert pin(before[-1:])  # the trainer on its own core, then the writer's thread starts

        def where() -> tuple[str, int, set[int]]:
            me = threading.get_native_id()
            return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, me), os.sched_getaffinity(me)

        name, priority, cores = writer.submit(where).result(10)
        assert name.startswith("checkpoint-writer") and priority == nice
        assert cores == set(spare or before[-1:])  # one core: it shares the trainer's
        assert lowered.submit(where).result(10)[1] == max(nice, LOWEST_PRIORITY)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == nice
        assert os.sched_getaffinity(0) == set(before[-1:])
    finally:
        writer.shutdown()
        lowered.shutdown()
        pin(before)


LOWERED = """
import os, threading
from astraflow.runtime import lower_priority
ready, done, seen = threading.Event(), threading.Event(), {}
def early():
    ready.set()
    done.wait(10)
    seen["early"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
t = threading.Thread(target=early)
t.start()
ready.wait(10)
first = lower_priority(os.getpriority(os.PRIO_PROCESS, 0) + 3)
late = threading.Thread(target=lambda: seen.setdefault("late", os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
late.start()
late.join(10)
done.set()
t.join(10)
print(first, lower_priority(0), seen["early"], seen["late"], os.getpriority(os.PRIO_PROCESS, 0))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_lowering_the_priority_moves_every_thread_and_the_threads_started_later_and_never_raises_it():
    """The evaluator lowers itself once started (``eval.nice``): its threads already running, and those it starts later,
    run at that priority; a priority above the one it has is left alone (raising needs a privilege). In a child process:
    a priority lowered cannot be raised again."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > 16:
        pytest.skip("this process runs at a priority too low to lower by 3")
    out = subprocess.run([sys.executable, "-c", LOWERED], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", *[str(nice + 3)] * 3]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_role_keeps_to_its_cores_only_once_started():
    """``up`` starts the roles beside a pinned trainer on every core and moves them to the cores left once started, so
    their start-ups (imports, model build) do not queue on one core while the trainer's sits idle."""
    from astraflow.role import Role, RoleOptions
    from astraflow.streams.plane import NatsOptions

    before = usable_core_ids()
    role = Role("rollout", RoleOptions(nats=NatsOptions(url="nats://127.0.0.1:1"), run="r", worker_id="w",
                                       cores=(before[-1],)), 5.0)
    assert usable_core_ids() == before  # not entered, nothing pinned: the start-up runs anywhere
    try:
        role.started()
        assert usable_core_ids() == [before[-1]]
        pin(before)
        role.started()  # once only: a second call moves nothing
        assert usable_core_ids() == before
    finally:
        pin(before)
    for bad in ((), (-1,)):
        with pytest.raises(ValueError, match="cores"):
            RoleOptions(nats=NatsOptions(url="nats://127.0.0.1:1"), run="r", worker_id="w", cores=bad)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_pin_group_moves_every_thread_of_a_role_and_of_what_it_started():
    """``up`` widens the evaluator's cores from the launcher once the trainers are done: every thread of the role's
    process group moves, its children's too, and nothing outside the group."""
    cores = usable_core_ids()
    code = ("import subprocess, sys, threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)")
    role = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, process_group=0)
    try:
        assert role.stdout is not None and role.stdout.readline().strip() == "up"
        group = []
        for _ in range(100):  # the child's interpreter may still be starting
            group = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgrp(p) == role.pid]
            if len(group) == 2:
                break
            time.sleep(0.05)
        tids = [int(t) for p in group for t in os.listdir(f"/proc/{p}/task")]
        assert len(group) == 2 and len(tids) >= 3, (group, tids)
        assert pin_group(role.pid, [cores[0]]) >= len(tids)
        assert all(os.sched_getaffinity(t) == {cores[0]} for t in tids)
        assert usable_core_ids() == cores  # the caller's own threads are not in the group
        assert pin_group(role.pid, cores) >= len(tids) and all(os.sched_getaffinity(t) == set(cores) for t in tids)
    finally:
        os.killpg(role.pid, 9)
        role.wait(10)
    deadline = time.monotonic() + 5  # SIGKILL lands on the orphaned child a moment later
    while pin_group(role.pid, cores) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pin_group(role.pid, cores) == 0  # a group gone: nothing to move, no error


def _pgrp(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[2])
    except OSError:
        return None
