"""Chaos under the one command users run: kill -9 every role of ``astraflow up`` (each at least once),
then the launcher itself, then ``up --resume``. The run completes, every version is announced
exactly once, the accounting adds up, no process outlives its launcher, and the policy learns."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from learning import held_out_rose

from astraflow.config import load_recipe

ROLES = ("trainer-solver", "dataflow", "evaluator", "rollout-0", "rollout-1")
STEPS = 100


def children(pid: int) -> dict[int, str]:
    """Live child processes of ``pid`` -> the role they run (their ``--id``)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid, state = int(stat.rsplit(")", 1)[1].split()[1]), stat.rsplit(")", 1)[1].split()[0]
        if ppid == pid and state != "Z" and b"--id" in cmd:
            out[int(entry.name)] = cmd[cmd.index(b"--id") + 1].decode()
    return out


def processes_of(run_dir: Path) -> list[int]:
    """Every live process whose command line names the run directory (roles, the server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                named = str(run_dir).encode() in (entry / "cmdline").read_bytes()
                if named and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def versions(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["version"] for line in path.read_text().splitlines() if line.strip()]


def wait(cond, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_up_survives_kill_9_of_every_role_and_of_itself(repo_root: Path, tmp_path: Path):
    run_dir = tmp_path / "chaos"
    up = [sys.executable, "-m", "astraflow.cli", "up"]
    sets = ["--set", f"trainer.steps={STEPS}", "--set", "sft.steps=250", "--set", "eval.every=50", "--set", "plane.task_ack_wait=5",
            "--set", "plane.traj_ack_wait=5", "--set", "plane.batch_ack_wait=10", "--timeout", "600"]
    log = open(tmp_path / "up.log", "w")
    launcher = subprocess.Popen([*up, str(repo_root / "recipes" / "arithmetic"), "--run-dir", str(run_dir), *sets], stdout=log,
                                stderr=subprocess.STDOUT)
    rng = random.Random(0)
    killed: dict[str, int] = {}
    try:
        wait(lambda: set(children(launcher.pid).values()) >= set(ROLES), "every role to start", 120)
        wait(lambda: len(versions(run_dir)) >= 3, "training to start", 240)  # after the warm start
        order = rng.sample(ROLES, len(ROLES)) + [rng.choice(ROLES)]
        for name in order:  # each role at least once, in a random order, then one more at random
            wait(lambda: name in children(launcher.pid).values(), f"{name} to be running", 60)
            pid = next(p for p, n in children(launcher.pid).items() if n == name)
            os.kill(pid, signal.SIGKILL)
            killed[name] = killed.get(name, 0) + 1
            wait(lambda: any(n == name and p != pid for p, n in children(launcher.pid).items()), f"{name} to be restarted", 60)
        assert launcher.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        mid = len(versions(run_dir))
        assert mid < STEPS + 1, "the run finished before the launcher could be killed: lengthen it"
        launcher.kill()  # the launcher itself: every role and the embedded server must follow within 5 s
        launcher.wait()
        deadline = time.monotonic() + 5
        while (left := processes_of(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for pid in left]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()
    resumed = subprocess.run([*up, "--resume", str(run_dir), "--timeout", "600"], capture_output=True, text=True, timeout=700)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-8000:]  # a stalled run says where it stood
    assert not processes_of(run_dir)
    assert versions(run_dir) == list(range(STEPS + 1))  # every version exactly once, across the kills and both sessions
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sessions"] == 2 and summary["outcome"] == "finished"
    for name in killed:  # each killed role was restarted by the supervisor in the first session
        assert summary["restarts"].get(name, 0) >= 1, (name, summary["restarts"])
    acc = summary["accounting"]["solver"]
    assert acc["adds_up"] and acc["total"] == acc["in_flight"] + acc["buffered"] + acc["awaiting"] + sum(acc["fates"].values())
    assert held_out_rose(summary, by=0.05), summary  # it still learns
    for output in ((tmp_path / "up.log").read_text(), resumed.stdout):  # a killed node's tasks, answered again by another,
        assert "quarantined" not in output, output[-3000:]             # blame no honest node


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_restarts_a_trainer_killed_during_its_warm_start(repo_root: Path, tmp_path: Path):
    """kill -9 of the trainer before version 0 exists: ``up`` restarts it, the new trainer warm-starts from the
    beginning on the thread count ``up`` wrote into the run's recipe, and the run ends with every version once."""
    run_dir, steps = tmp_path / "warm-kill", 6
    sets = ["--set", f"trainer.steps={steps}", "--set", "sft.steps=1000", "--set", "eval.every=3", "--timeout", "420",
            "--set", "trainer.kl_coef=0.05"]  # as the agentic recipes: the KL reference is the restarted warm start's
    log = open(tmp_path / "up.log", "w")
    launcher = subprocess.Popen([sys.executable, "-m", "astraflow.cli", "up", str(repo_root / "recipes" / "arithmetic"),
                                 "--run-dir", str(run_dir), *sets], stdout=log, stderr=subprocess.STDOUT)
    trainer_log = run_dir / "logs" / "trainer-solver.s1.log"
    try:
        wait(lambda: trainer_log.exists() and "SFT warm start begins" in trainer_log.read_text(), "the trainer's warm start", 120)
        time.sleep(1)
        assert not versions(run_dir) and "training on" not in trainer_log.read_text(), "the warm start ended before the kill"
        pid = next(p for p, n in children(launcher.pid).items() if n == "trainer-solver")
        os.kill(pid, signal.SIGKILL)
        assert launcher.wait(timeout=500) == 0, (tmp_path / "up.log").read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["restarts"].get("trainer-solver", 0) >= 1, summary["restarts"]
    assert versions(run_dir) == list(range(steps + 1))
    assert (run_dir / "checkpoints" / "solver" / "reference.safetensors").exists()  # written once, after the warm start
    threads = load_recipe(run_dir / "recipe.yaml").policies["solver"].sft.threads  # the count up chose and wrote down
    text = trainer_log.read_text()  # one log per role and session: the restarted trainer appends to it
    assert re.findall(r"SFT warm start begins: 1000 steps on (\d+) threads", text) == [str(threads)] * 2
    assert re.findall(r"SFT warm start: 1000 steps in \d+ s on (\d+) threads", text) == [str(threads)]  # one finished


def servers_of(launcher: int) -> dict[int, str]:
    """The launcher's live nats-server children -> their name (``nats-server``, or ``n{i}`` in an embedded cluster)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat[1]) == launcher and stat[0] != "Z" and b"nats-server" in cmd[0]:
                member = re.search(r"/cluster/(n\d+)/", cmd[2].decode())
                out[int(entry.name)] = member.group(1) if member else "nats-server"
    return out


def server_of(launcher: int) -> int | None:
    """The live embedded nats-server of the launcher, if any."""
    return next(iter(servers_of(launcher)), None)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_restarts_its_killed_server_and_a_sigint_to_the_launcher_alone_stops_it(repo_root: Path, tmp_path: Path):
    """kill -9 of the embedded nats-server, twice: ``up`` reaps it and starts it again on its address with its store,
    the roles reconnect and training goes on. Then SIGINT to the launcher alone (as ``timeout`` sends it, not to the
    process group as a terminal's Ctrl-C does), and SIGTERM again and again while it stops (``timeout`` sends its signal
    twice, to the launcher and to its group; a process manager may repeat it): the run ends ``stopped``, without a
    traceback, with its summary and its session closed, and nothing outlives it."""
    run_dir, steps = tmp_path / "server-kill", 400
    sets = ["--set", f"trainer.steps={steps}", "--set", "sft.steps=150", "--set", "eval.every=100", "--timeout", "500"]
    log_path = tmp_path / "up.log"
    log = open(log_path, "w")
    launcher = subprocess.Popen([sys.executable, "-m", "astraflow.cli", "up", str(repo_root / "recipes" / "arithmetic"),
                                 "--run-dir", str(run_dir), *sets], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait(lambda: len(versions(run_dir)) >= 3, "training to start", 240)
        for _ in range(2):
            pid, at = server_of(launcher.pid), len(versions(run_dir))
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            wait(lambda: server_of(launcher.pid) not in (None, pid), "the server to be restarted", 30)
            wait(lambda: len(versions(run_dir)) >= at + 5, "training to go on after the restart", 120)
        assert launcher.poll() is None and len(versions(run_dir)) < steps + 1, "the run ended before the SIGINT: lengthen it"
        launcher.send_signal(signal.SIGINT)
        noted, deadline = 0, time.monotonic() + 60
        while launcher.poll() is None and noted < 3 and time.monotonic() < deadline:  # into its drain: the default would end it
            launcher.send_signal(signal.SIGTERM)
            noted += "already stopping" in log_path.read_text()
            time.sleep(0.05)
        assert noted, log_path.read_text()[-3000:]  # a repeated signal reached it while it stopped, and was noted
        assert launcher.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()
    output = log_path.read_text()
    assert "Traceback" not in output, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "stopped" and summary["restarts"].get("nats-server") == 2, (summary["outcome"], summary["restarts"])
    assert json.loads((run_dir / "sessions.jsonl").read_text().splitlines()[-1])["end"] is not None
    seen = versions(run_dir)
    assert seen == list(range(len(seen)))  # every version once, across both restarts
    acc = summary["accounting"]["solver"]
    assert acc["adds_up"], acc
    assert "quarantined" not in output, output[-3000:]  # tasks a restart gave to a second node blame no honest node
    assert not processes_of(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stop_signal_while_up_sets_up_ends_the_run_stopped_with_nothing_left(repo_root: Path, tmp_path: Path):
    """SIGTERM to the launcher the moment its session begins, while it starts the embedded server and makes the
    topology, before its event loop holds the stop signals: the default action would end it there, with no summary and
    its session never closed. The signal is noted and acted on once the loop runs: no role starts, the run ends
    ``stopped`` with its summary, and nothing outlives it."""
    run_dir = tmp_path / "early-stop"
    sessions = run_dir / "sessions.jsonl"
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "astraflow.cli", "up", str(repo_root / "recipes" / "arithmetic"),
                                     "--run-dir", str(run_dir), "--set", "sft.steps=0", "--set", "trainer.steps=5"],
                                    stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not sessions.exists() and launcher.poll() is None:
                assert time.monotonic() < deadline, "timed out waiting for the session to begin"
                time.sleep(0.001)
            launcher.send_signal(signal.SIGTERM)
            code = launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    output = log_path.read_text()
    assert code == 0, output[-3000:]
    assert "SIGTERM: stopping as soon as the run is set up" in output, output[-3000:]  # it landed before the loop held it
    assert "Traceback" not in output, output[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["outcome"] == "stopped"
    assert json.loads(sessions.read_text().splitlines()[-1])["outcome"] == "stopped"
    assert not [p.name for p in run_dir.glob("logs/*") if p.name.startswith(("trainer", "rollout", "dataflow", "evaluator"))]  # none began
    assert not processes_of(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_on_an_embedded_cluster_rides_through_members_killed_again_and_again(repo_root: Path, tmp_path: Path):
    """``up --cluster 3``: the run's streams replicated on three servers. A member killed at random moments, three times
    (one at a time: each comes back, with its store, before the next; at least twice if the run ends first): the run
    finishes with every version once and the accounting adds up."""
    run_dir, steps = tmp_path / "cluster-chaos", 90
    log_path = tmp_path / "up.log"
    log = open(log_path, "w")
    launcher = subprocess.Popen([sys.executable, "-m", "astraflow.cli", "up", str(repo_root / "recipes" / "arithmetic"),
                                 "--cluster", "3", "--run-dir", str(run_dir), "--set", f"trainer.steps={steps}", "--set",
                                 "sft.steps=150", "--set", "eval.every=40", "--timeout", "500"], stdout=log, stderr=subprocess.STDOUT)
    rng = random.Random(1)
    killed = []
    try:
        wait(lambda: len(versions(run_dir)) >= 3, "training to start", 240)
        for _ in range(3):
            wait(lambda: len(servers_of(launcher.pid)) == 3 or launcher.poll() is not None, "every member to be up", 30)
            if launcher.poll() is not None:  # the run ended while a killed member came back
                break
            pid, name = rng.choice(sorted(servers_of(launcher.pid).items()))
            at = len(versions(run_dir))
            os.kill(pid, signal.SIGKILL)
            killed.append(name)
            wait(lambda: len(versions(run_dir)) >= at + 3 or launcher.poll() is not None, "training to go on", 120)
            time.sleep(rng.uniform(0.5, 3.0))
        assert launcher.wait(timeout=400) == 0, log_path.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()
    assert len(killed) >= 2, f"the run ended after {len(killed)} kill(s)"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "finished", summary["outcome"]
    assert sum(v for k, v in summary["restarts"].items() if k.startswith("nats-server-")) == len(killed), summary["restarts"]
    assert versions(run_dir) == list(range(steps + 1))  # every version once, across the kills
    acc = summary["accounting"]["solver"]
    assert acc["adds_up"], acc
    assert not processes_of(run_dir)
