"""The supervisor of ``astraflow up`` with real child processes: restarts with backoff, crash loops,
finished roles, retired nodes, the local pool, and children that die with the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astraflow.launch.supervisor import CrashLoop, LocalPool, RoleSpec, Supervisor
from astraflow.launch.up import enforce

PY = sys.executable


def command(spec: RoleSpec) -> list[str]:
    """Each test role is a tiny Python program named by its args: ``sleep``, ``exit N`` or ``flaky PATH``."""
    kind, *rest = spec.args
    if kind == "sleep":
        return [PY, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    if kind == "burn":  # spends about a CPU second, then dies (a crash: restarted)
        return [PY, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\nraise SystemExit(1)"]
    if kind == "exit":
        return [PY, "-c", f"print('failing on purpose', flush=True); raise SystemExit({rest[0]})"]
    # flaky: dies until its marker file exists, then sleeps
    return [PY, "-c", f"import os, time, sys; sys.exit(3) if not os.path.exists({rest[0]!r}) else time.sleep(60)"]


def poll_until(sup: Supervisor, cond, timeout: float = 20.0) -> list[str]:
    events: list[str] = []
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not reached; events so far: {events}"
        events += sup.poll()
        time.sleep(0.02)
    return events


@pytest.fixture
def sup(tmp_path: Path):
    s = Supervisor(command, lambda name: tmp_path / f"{name}.log", backoff_base_s=0.05, backoff_max_s=0.2, max_crashes=3, window_s=60)
    yield s
    s.stop(timeout=5)


def test_a_killed_role_is_restarted_and_counted(sup: Supervisor, tmp_path: Path):
    child = sup.start(RoleSpec("dataflow", "dataflow", ("sleep",)))
    log = tmp_path / "dataflow.log"
    poll_until(sup, lambda: "up\n" in log.read_text())
    first = child.proc.pid
    os.kill(first, signal.SIGKILL)
    events = poll_until(sup, lambda: child.restarts == 1 and child.alive())
    assert child.proc.pid != first and sup.restarts == {"dataflow": 1}
    assert any("killed by SIGKILL" in e for e in events)
    poll_until(sup, lambda: log.read_text().count("up\n") == 2)  # one log, both lives
    assert "restart 1 of dataflow after killed by SIGKILL" in log.read_text()


def test_a_role_starts_and_restarts_at_its_cpu_priority(sup: Supervisor, tmp_path: Path):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    node = sup.start(RoleSpec("rollout-0", "rollout", ("sleep",), nice=7))
    trainer = sup.start(RoleSpec("trainer-solver", "trainer", ("sleep",), finishes=True))
    poll_until(sup, lambda: "up\n" in (tmp_path / "rollout-0.log").read_text())
    assert os.getpriority(os.PRIO_PROCESS, node.proc.pid) == min(base + 7, 19)
    assert os.getpriority(os.PRIO_PROCESS, trainer.proc.pid) == base
    first = node.proc.pid
    os.kill(first, signal.SIGKILL)
    poll_until(sup, lambda: node.restarts == 1 and node.alive())
    assert node.proc.pid != first and os.getpriority(os.PRIO_PROCESS, node.proc.pid) == min(base + 7, 19)


def test_up_yields_the_cores_of_generation_to_the_trainers(tmp_path: Path):
    from astraflow.config import parse_recipe
    from astraflow.launch.rundir import RunDir
    from astraflow.launch.up import added_node, role_specs

    recipe = parse_recipe({"name": "t", "policies": ["solver", "verifier"], "rollout": {"nodes": 2, "nice": 12}})
    nice = {s.name: s.nice for s in role_specs(recipe, RunDir(tmp_path / "run"), None)}
    assert nice == {"trainer-solver": 0, "trainer-verifier": 0, "dataflow": 0, "evaluator": 12, "rollout-0": 12, "rollout-1": 12}
    default = parse_recipe({"name": "t"})
    assert {s.name: s.nice for s in role_specs(default, RunDir(tmp_path / "run"), None)}["rollout-0"] == default.rollout.nice > 0
    specs = role_specs(recipe, RunDir(tmp_path / "run"), 9000)
    added = added_node(recipe, specs)("rollout-7")  # what --autoscale starts: the first node's spec, renamed
    assert (added.name, added.role, added.nice, added.args) == ("rollout-7", "rollout", 12, specs[-2].args)
    assert added_node(parse_recipe({"name": "t", "rollout": {"nodes": 0, "nice": 5}}), [])("rollout-0").nice == 5


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_role_starts_and_restarts_on_its_cores(sup: Supervisor, tmp_path: Path):
    last = max(os.sched_getaffinity(0))
    node = sup.start(RoleSpec("rollout-0", "rollout", ("sleep",), cores=(last,)))
    anywhere = sup.start(RoleSpec("dataflow", "dataflow", ("sleep",)))
    poll_until(sup, lambda: "up\n" in (tmp_path / "rollout-0.log").read_text())
    assert os.sched_getaffinity(node.proc.pid) == {last}
    assert os.sched_getaffinity(anywhere.proc.pid) == os.sched_getaffinity(0)
    os.kill(node.proc.pid, signal.SIGKILL)
    poll_until(sup, lambda: node.restarts == 1 and node.alive())
    assert os.sched_getaffinity(node.proc.pid) == {last}


def test_up_keeps_every_role_but_the_trainer_off_its_cores(tmp_path: Path):
    from astraflow.config import parse_recipe
    from astraflow.launch.rundir import RunDir
    from astraflow.launch.up import added_node, role_specs
    from astraflow.train.threads import with_core_plan, with_thread_counts

    recipe = with_core_plan(with_thread_counts(parse_recipe({"name": "t", "rollout": {"nodes": 1}}), 4), [0, 1, 2, 3], False)
    assert recipe.policies["solver"].trainer.cores == [2, 3]  # 4 cores - 1 node - the evaluator
    specs = role_specs(recipe, RunDir(tmp_path / "run"), None, cores=[0, 1, 2, 3])
    # every role starts on every core (the trainer warm-starts there), then keeps to its own: the trainer to
    # trainer.cores, the others to those left (--cores, ``Role.started``)
    assert {s.cores for s in specs} == {(0, 1, 2, 3)}
    assert {s.name: s.args[s.args.index("--cores") + 1] for s in specs if s.role != "trainer"} == {
        "dataflow": "0,1", "evaluator": "0,1", "rollout-0": "0,1"}
    assert "--cores" not in next(s for s in specs if s.role == "trainer").args
    assert added_node(recipe, specs)("rollout-5").args == next(s for s in specs if s.name == "rollout-0").args
    shared = parse_recipe({"name": "t", "trainer": {"cores": "shared"}})
    assert {s.cores for s in role_specs(shared, RunDir(tmp_path / "run"), None, cores=[0, 1, 2, 3])} == {None}
    assert not any("--cores" in s.args for s in role_specs(shared, RunDir(tmp_path / "run"), None, cores=[0, 1, 2, 3]))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_the_embedded_server_runs_on_the_cores_it_is_given(tmp_path: Path):
    from astraflow.streams.server import EmbeddedServer

    last = max(os.sched_getaffinity(0))
    server = EmbeddedServer(tmp_path, cores=(last,)).start()
    try:
        assert server.proc is not None
        assert all(os.sched_getaffinity(int(t)) == {last} for t in os.listdir(f"/proc/{server.proc.pid}/task"))
    finally:
        server.stop()


def test_a_crash_loop_stops_with_the_log_tail(sup: Supervisor):
    sup.start(RoleSpec("trainer-solver", "trainer", ("exit", "1"), finishes=True))
    with pytest.raises(CrashLoop, match="trainer-solver crashed 4 times") as e:
        poll_until(sup, lambda: False)
    assert "failing on purpose" in e.value.tail


def test_a_role_that_recovers_is_not_a_crash_loop(tmp_path: Path):
    sup = Supervisor(command, lambda name: tmp_path / f"{name}.log", backoff_base_s=0.05, backoff_max_s=0.2, max_crashes=20)
    marker = tmp_path / "ready"
    child = sup.start(RoleSpec("rollout-0", "rollout", ("flaky", str(marker))))
    try:
        poll_until(sup, lambda: child.restarts >= 2)
        marker.touch()  # this life or the next finds it and stays up
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            sup.poll()
            time.sleep(0.02)
        settled = child.restarts
        time.sleep(0.5)
        sup.poll()
        assert child.alive() and child.state == "running" and child.restarts == settled
    finally:
        sup.stop(timeout=5)


def test_finished_and_retired_roles_stay_down(sup: Supervisor):
    done = sup.start(RoleSpec("evaluator", "evaluator", ("exit", "0"), finishes=True))
    node = sup.start(RoleSpec("rollout-0", "rollout", ("sleep",)))
    sup.retire("rollout-0")
    poll_until(sup, lambda: done.state == "done" and not node.alive())
    time.sleep(0.3)
    sup.poll()
    assert (done.state, node.state, done.restarts, node.restarts) == ("done", "retired", 0, 0)


def test_local_pool_moves_one_node_at_a_time_toward_the_target(sup: Supervisor):
    sup.start(RoleSpec("trainer-solver", "trainer", ("sleep",), finishes=True))
    sup.start(RoleSpec("rollout-0", "rollout", ("sleep",)))
    pool = LocalPool(sup, lambda name: RoleSpec(name, "rollout", ("sleep",)), cooldown_s=10)
    assert pool.act(3, now=0.0) == "started rollout-1 (2/3)"
    assert pool.act(3, now=5.0) is None  # cooldown
    assert pool.act(3, now=10.0) == "started rollout-2 (3/3)"
    assert pool.act(3, now=30.0) is None  # at target
    assert pool.act(1, now=40.0) == "retiring rollout-2 (2/1)"
    poll_until(sup, lambda: not sup.children["rollout-2"].alive())
    assert [c.name for c in sup.live("rollout")] == ["rollout-0", "rollout-1"]


def test_children_die_with_the_launcher(tmp_path: Path):
    """A launcher killed with SIGKILL: its children get SIGHUP from the kernel and are gone at once."""
    script = tmp_path / "launcher.py"
    pids = tmp_path / "pids"
    script.write_text(
        "import sys, time\n"
        "from astraflow.launch.supervisor import RoleSpec, Supervisor\n"
        f"sup = Supervisor(lambda s: [{PY!r}, '-c', 'import time; time.sleep(120)'],\n"
        f"                 lambda n: __import__('pathlib').Path({str(tmp_path)!r}) / n)\n"
        "kids = [sup.start(RoleSpec(f'r{i}', 'rollout')) for i in range(3)]\n"
        f"open({str(pids)!r}, 'w').write(' '.join(str(k.proc.pid) for k in kids))\n"
        "time.sleep(120)\n"
    )
    launcher = subprocess.Popen([PY, str(script)])
    deadline = time.monotonic() + 20
    while not pids.exists() or not pids.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    children = [int(p) for p in pids.read_text().split()]
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in children):
        assert time.monotonic() < deadline, "children outlived the launcher by 5 s"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its (dead) parent is gone for our purpose
        return f.read().split()[2] != "Z"


def test_cpu_seconds_of_every_instance_are_counted(sup: Supervisor, tmp_path: Path):
    child = sup.start(RoleSpec("trainer-solver", "trainer", ("burn",)))
    poll_until(sup, lambda: child.restarts >= 1 and not child.alive())  # two instances have burnt and died
    assert child.cpu_s >= 1.9, child.cpu_s  # both, from wait4: the first was replaced, not forgotten
    sup.start(RoleSpec("rollout-0", "rollout", ("sleep",)))
    poll_until(sup, lambda: "up\n" in (tmp_path / "rollout-0.log").read_text())  # started: its interpreter has used some CPU
    sup.stop(timeout=5)  # reaps the sleeper (and whatever instance of the burner runs) with its CPU time
    assert sup.cpu_s["trainer-solver"] >= 1.9 and 0 < sup.cpu_s["rollout-0"] < 1.0, sup.cpu_s


def test_a_role_dies_with_its_launcher_even_under_nohup():
    """A launcher started under ``nohup`` ignores SIGHUP, and an ignored disposition survives exec: a role still
    connecting (before it installs its own handler) would outlive its launcher. The preexec hook restores it."""
    import os
    import signal
    import sys
    import time

    from astraflow.launch.supervisor import _hangup_with_parent

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the launcher, under nohup: it starts a role that is still connecting, then dies
        try:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=_hangup_with_parent)
            os.write(w, str(child.pid).encode())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    child = int(os.read(r, 32))
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the role outlived its launcher"
        time.sleep(0.05)


def test_a_quarantined_node_of_the_launcher_is_stopped_not_restarted_and_started_again_once_let_back_in(tmp_path: Path):
    sup = Supervisor(command, lambda name: tmp_path / f"{name}.log")
    for name in ("rollout-0", "rollout-1"):
        sup.start(RoleSpec(name, "rollout", ("sleep",)))
    assert enforce(None, sup, {"rollout-1", "elsewhere"}) == ["stopped rollout-1: quarantined"]
    first = sup.children["rollout-1"].proc
    first.wait(timeout=10)
    assert sup.poll() == [] and sup.children["rollout-1"].state == "quarantined"  # its exit is no crash: no restart
    assert [c.name for c in sup.live("rollout")] == ["rollout-0"]
    assert enforce(None, sup, {"elsewhere"}) == ["started rollout-1 again: let back in"]
    assert sup.children["rollout-1"].alive() and sup.children["rollout-1"].proc is not first
    sup.stop(timeout=5)


def test_what_a_killed_role_started_goes_with_it(tmp_path: Path):
    """A role's process group goes with it: the processes it started (an in-process vLLM's engine core and workers, a
    sandbox) are ended when it dies, not left holding memory while it is started again and again; and at the end."""
    grandchildren = tmp_path / "grandchildren"

    def leaves_a_child(spec: RoleSpec) -> list[str]:  # starts a process of its own, as vLLM starts its engine core
        return ["bash", "-c", f"sleep 300 & echo $! >> {grandchildren}; exec sleep 300"]

    sup = Supervisor(leaves_a_child, lambda name: tmp_path / f"{name}.log", backoff_base_s=0.5, backoff_max_s=0.5)
    try:
        child = sup.start(RoleSpec("rollout-0", "rollout"))
        deadline = time.monotonic() + 10
        while not grandchildren.exists() or not grandchildren.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first = int(grandchildren.read_text().split()[0])
        os.kill(child.proc.pid, signal.SIGKILL)
        poll_until(sup, lambda: not _alive(first), timeout=5)  # gone with the role, before it is started again
        poll_until(sup, lambda: child.restarts == 1 and len(grandchildren.read_text().split()) == 2)
        second = int(grandchildren.read_text().split()[1])
        assert _alive(second)
    finally:
        sup.stop(timeout=5)
    deadline = time.monotonic() + 5
    while _alive(second):
        assert time.monotonic() < deadline, "a role's process outlived the run"
        time.sleep(0.05)


def test_a_server_a_node_launched_ends_when_the_node_is_killed(tmp_path: Path):
    """``ServerProcess`` (sglang, vllm launched by the node) runs in a session of its own, yet gets SIGTERM from the
    kernel when the node dies without stopping it."""
    pid_file = tmp_path / "server.pid"
    node = subprocess.Popen([PY, "-c", "import time; from pathlib import Path\n"
                             "from astraflow.rollout.engines.remote import ServerProcess\n"
                             f"s = ServerProcess(['sleep', '300'], None, Path({str(tmp_path / 'server.log')!r}))\n"
                             f"Path({str(pid_file)!r}).write_text(str(s.proc.pid)); time.sleep(300)"])
    try:
        deadline = time.monotonic() + 20
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server = int(pid_file.read_text())
        assert _alive(server)
    finally:
        node.kill()
        node.wait()
    deadline = time.monotonic() + 5
    while _alive(server):
        assert time.monotonic() < deadline, "the launched server outlived its node"
        time.sleep(0.05)
