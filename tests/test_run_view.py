"""What ``astraflow up`` shows: the live view says what the run waits for, and the summary reads as figures with units,
not as JSON (``astraflow/launch/view.py``, ``astraflow/launch/summary_tables.py``)."""

from __future__ import annotations

import io
import time

import pytest
from factories import a_keyframe_announcement
from rich.console import Console

from astraflow.config import load_recipe, parse_recipe
from astraflow.launch.rundir import RunDir
from astraflow.launch.summary_tables import duration, held_out, size, summary_tables
from astraflow.launch.view import NO_NODE_HINT_S, View
from astraflow.launch.watcher import Live, RunWatcher
from astraflow.streams.messages import DataflowStats, Heartbeat, RolloutStats, TrainerStats
from astraflow.streams.plane import Plane
from astraflow.streams.state import StateReadError

SUMMARY = {
    "recipe": "arithmetic", "outcome": "finished", "wall_s": 37.1, "sessions": 2, "restarts": {"rollout-0": 1},
    "eval_policy": "solver", "samples": 5464,
    "cpu_s": {"trainer-solver": 23.32, "dataflow": 3.4, "launcher": 1.83},
    "cpu_s_per_64_samples": {"trainer-solver": 0.273, "dataflow": 0.04, "launcher": 0.021},
    "held_out_reward": {"0": 0.51, "10": 0.6, "70": 0.73, "80": 0.6},
    "held_out_others": {"team": {"0": {"reward": 0.2, "avg@k": 0.1, "pass@k": 0.3}, "80": {"reward": 0.4, "avg@k": 0.2, "pass@k": 0.5}}},
    "policies": {"solver": {"steps": 80, "versions": 81, "train_reward_last5": 0.478125, "keyframe_bytes": 230166,
                            "delta_bytes_mean": 52805.180555555555}},
    "accounting": {"solver": {"basis": "issued", "total": 684, "in_flight": 0, "buffered": 16, "awaiting": 16,
                              "fates": {"dropped:stale": 12, "trained": 640}, "adds_up": True}},
}


def rendered(summary: dict) -> str:
    console = Console(record=True, width=200)
    for table in summary_tables(summary):
        console.print(table)
    return console.export_text()


def test_the_summary_shows_formatted_figures_not_json():
    text = rendered(SUMMARY)
    assert "{" not in text and '"' not in text, text
    assert "0.510 (v0) → 0.600 (v80), best 0.730 (v70)" in text
    assert "0.200 (v0) → 0.400 (v80)" in text  # a team's other subject
    assert "5,464 (147.3 per second" in text
    assert "2 · rollout-0 ×1" in text
    assert "keyframe 224.8 KiB · delta 51.6 KiB (mean)" in text
    assert "684 issued: 640 trained, 12 dropped:stale, 16 buffered, 16 awaiting training; adds up" in text
    cpu_rows = [line for line in text.splitlines() if "trainer-solver" in line or "launcher" in line]
    assert "23.3" in cpu_rows[0] and "82 %" in cpu_rows[0] and "0.273 s" in cpu_rows[0]
    assert "launcher" in cpu_rows[1]  # largest first


def test_a_killed_session_without_cpu_figures_still_renders():
    text = rendered({**SUMMARY, "cpu_s": {}, "cpu_s_per_64_samples": {}, "held_out_reward": {}, "accounting": {}})
    assert "not evaluated" in text and "CPU per process" not in text


def test_units():
    assert [duration(s) for s in (37.14, 245, 3720)] == ["37.1 s", "4 min 05 s", "1 h 02 min"]
    assert [size(n) for n in (512, 230166, 3 * 2**30)] == ["512 B", "224.8 KiB", "3.0 GiB"]
    assert held_out({"0": 0.5}) == "0.500 (v0)"
    assert held_out({"0": 0.5, "10": 0.7}) == "0.500 (v0) → 0.700 (v10)"  # the best is the last: not repeated


def test_the_live_view_says_what_the_run_waits_for(repo_root):
    recipe = load_recipe(repo_root / "recipes" / "arithmetic")
    assert recipe.policies["solver"].sft.steps > 0
    view = View(recipe, Console(file=io.StringIO()), "astraflow worker rollout --credential C --recipe R")
    live = Live()
    waiting = view.waiting_for(live, local_nodes=2)  # the warm start: its own nodes are up and wait for v0, no join hint
    assert waiting is not None and waiting.startswith("waiting for v0: the trainer's warm start")
    assert "2 rollout nodes of this run start and wait for it" in waiting and "join" not in waiting.lower()
    warm = TrainerStats(warm_start_steps=200, warm_start_done=120)
    live.beats["trainer-solver"] = (Heartbeat(worker_id="trainer-solver", policy="solver", stats=warm, state="starting"), time.monotonic())
    assert view.waiting_for(live, local_nodes=2) == ("waiting for v0: the warm start, SFT steps solver 120/200; "
                                                     "2 rollout nodes of this run start and wait for it")
    del live.beats["trainer-solver"]
    live.versions["solver"] = 0
    assert view.waiting_for(live, local_nodes=2) is None  # v0 is out: the nodes get a moment to beat
    view._nodes_seen = time.monotonic() - NO_NODE_HINT_S - 1
    assert view.waiting_for(live, local_nodes=2) == "waiting for 2 rollout nodes of this run to join (no heartbeat yet)"
    assert "Join one with: astraflow worker rollout" in view.waiting_for(live, local_nodes=0)  # none of its own: how to join
    live.beats["rollout-0"] = (Heartbeat(worker_id="rollout-0", stats=RolloutStats()), time.monotonic())
    assert view.waiting_for(live, local_nodes=0) is None
    line = view.line(live, {}, 12.0, view.waiting_for(live, local_nodes=0))
    assert "nodes 1" in line and "|  " not in line


def test_the_live_view_says_what_the_dataflow_refused(repo_root):
    view = View(load_recipe(repo_root / "recipes" / "arithmetic"), Console(file=io.StringIO()), "join")
    live = Live()
    assert "refused" not in view.line(live, {}, 1.0, None)
    stats = DataflowStats(counters={"duplicates": 3.0, "invalid.reward_claim": 2414.0, "invalid.prompt_claim": 2400.0,
                                    "invalid.reward_range": 12.0, "invalid.token": 1.0})
    live.beats["dataflow"] = (Heartbeat(worker_id="dataflow", stats=stats), time.monotonic())
    line = view.line(live, {}, 1.0, None)
    assert line.endswith("| refused 4,827: reward_claim 2,414, prompt_claim 2,400, reward_range 12")
    assert "refused 4,827" in str(view.table(live, {}).caption)


async def test_versions_fetched_in_a_turn_whose_state_read_fails_are_recorded_in_the_next(plane: Plane, tmp_path, monkeypatch):
    """A server restarting under the launcher fails the state read that follows the announcements' fetch: the versions
    fetched in that turn are recorded in the next one (the follower hands each over once), none is skipped."""
    rundir = RunDir(tmp_path / "run")
    rundir.prepare()
    watcher = RunWatcher(plane, parse_recipe({"name": "w", "trainer": {"steps": 10}}), rundir, set())
    read = plane.state.get

    async def failing(*args, **kwargs):
        raise StateReadError("dataflow state: TimeoutError (the server is restarting)")

    for v in range(3):
        await plane.publish(plane.names.weights("solver"), a_keyframe_announcement(v), msg_id=f"w{v}")
    monkeypatch.setattr(plane.state, "get", failing)
    with pytest.raises(StateReadError):
        await watcher.poll(2.0)
    monkeypatch.setattr(plane.state, "get", read)
    for v in range(3, 5):
        await plane.publish(plane.names.weights("solver"), a_keyframe_announcement(v), msg_id=f"w{v}")
    for _ in range(10):
        await watcher.poll(0.5)
        if len(list(rundir.rows("metrics.jsonl"))) == 5:
            break
    assert [r["version"] for r in rundir.rows("metrics.jsonl")] == [0, 1, 2, 3, 4]
    await watcher.stop()
