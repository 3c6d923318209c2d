"""A run that does not finish says where it stood: backlogs, each live worker's figures, each role's last warnings; and
how long a run took counts each session once."""

from __future__ import annotations

import time
from pathlib import Path

from astraflow.launch.diagnose import figures, stall_report, warnings_in
from astraflow.launch.rundir import RunDir
from astraflow.launch.watcher import STALE_BEATS, Live
from astraflow.streams.messages import HEARTBEAT_PERIOD_S, DataflowStats, Heartbeat, RolloutStats, TrainerStats


def test_the_report_names_each_live_worker_its_figures_and_its_roles_last_warnings(tmp_path: Path):
    live = Live()
    now = time.monotonic()
    live.lags = {"task": 16, "traj": 0, "batch.solver": 0}
    live.beats = {
        "dataflow": (Heartbeat(worker_id="dataflow", stats=DataflowStats(issued=800, in_flight=16, buffered=3,
                                                                         counters={"invalid.task": 2.0})), now),
        "rollout-0": (Heartbeat(worker_id="rollout-0", pool="raas", version=63,
                                stats=RolloutStats(tasks=400, counters={"stale_naks": 57.0}, weights={"solver": {"fallbacks": 1.0}})),
                      now),
        "trainer-solver": (Heartbeat(worker_id="trainer-solver", policy="solver", version=66, stats=TrainerStats(wait_s=512.0)), now),
        "rollout-9": (Heartbeat(worker_id="rollout-9", stats=RolloutStats(tasks=1)), now - 2 * STALE_BEATS * HEARTBEAT_PERIOD_S),
    }
    log = tmp_path / "rollout-0.s2.log"
    log.write_text("\n".join([
        "2026-11-26 22:10:03,398 INFO astraflow.rollout.node: joined",
        *(f"2026-11-26 22:11:0{i},000 WARNING astraflow.weights.sync: cannot reach v{64 + i}" for i in range(5)),
        "2026-11-26 22:12:00,000 INFO astraflow.rollout.node: still here",
    ]))
    report = stall_report(live, {"rollout-0": log, "dataflow": tmp_path / "missing.log"})
    lines = report.splitlines()
    assert lines[0] == "backlogs: task=16 traj=0 batch.solver=0"
    assert "dataflow (dataflow, running) v-1: issued=800 in_flight=16 buffered=3" in report and "invalid.task=2" in report
    assert "rollout-0 (rollout, running) v63: tasks=400" in report and "stale_naks=57" in report and "solver.fallbacks=1" in report
    assert "trainer-solver (trainer, running) v66: wait_s=512" in report
    assert "rollout-9" not in report  # gone: silent for longer than STALE_BEATS beats
    warned = [line for line in lines if line.startswith("rollout-0 log:")]
    assert [w.rsplit(" ", 1)[1] for w in warned] == ["v66", "v67", "v68"]  # the last three warnings, in order


def test_figures_leave_out_zeros_and_a_missing_log_has_no_warnings(tmp_path: Path):
    assert figures(Heartbeat(worker_id="n", stats=RolloutStats())) == "-"
    assert warnings_in(tmp_path / "nope.log") == []


def test_wall_time_counts_a_killed_launchers_session_up_to_its_own_last_sample(tmp_path: Path):
    rundir = RunDir(tmp_path / "run")
    rundir.path.mkdir()
    assert rundir.wall_s() == 0.0  # no session yet
    rundir.append("sessions.jsonl", {"session": 1, "start": 1000.0, "end": None})  # its launcher was killed
    rundir.append("sessions.jsonl", {"session": 2, "start": 2000.0, "end": 2600.0})
    for ts in (1002.0, 1027.0, 2010.0, 2590.0):
        rundir.append("pool.jsonl", {"wall_ts": ts})
    assert rundir.wall_s() == 27.0 + 600.0  # not up to session 2's last sample


async def test_sigusr2_logs_where_each_task_waits(caplog):
    """``kill -USR2 PID``: a role logs each task of its loop with the chain of awaits it is parked in."""
    import asyncio
    import logging
    import os
    import signal

    from astraflow.runtime import stop_event

    async def parked_in_a_publish() -> None:
        await asyncio.Event().wait()

    hangup = signal.getsignal(signal.SIGHUP)
    stop_event()  # installs a role's handlers, SIGUSR2's among them
    task = asyncio.create_task(parked_in_a_publish(), name="the-stuck-one")
    try:
        await asyncio.sleep(0)
        with caplog.at_level(logging.WARNING, logger="astraflow.runtime"):
            os.kill(os.getpid(), signal.SIGUSR2)
            await asyncio.sleep(0.1)
    finally:  # this process is the test runner, not a role
        task.cancel()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
            loop.remove_signal_handler(sig)
        signal.signal(signal.SIGHUP, hangup)
    text = caplog.text
    assert "--- the-stuck-one" in text and "parked_in_a_publish" in text and "locks.py" in text
