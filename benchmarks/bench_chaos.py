"""Recovery under ``astraflow up``: kill -9 each role once, then the launcher, then ``up --resume``;
side by side with a clean run of the same recipe on the same machine.

Per kill: how long until the supervisor had the role running again (``restart``), and how long
training stalled (the gap between the version announced just before the kill and the next one,
minus the clean run's median gap). For the launcher: the wall time from the kill to the first new
version after ``--resume`` (the resume includes process start-up and the model build). The run's
total stall is its wall time minus the clean run's.

    python benchmarks/bench_chaos.py [--steps 120]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("trainer-solver", "dataflow", "evaluator", "rollout-0", "rollout-1")


def role_pids(launcher: int) -> dict[str, int]:
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat, cmd = (entry / "stat").read_text(), (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        rest = stat.rsplit(")", 1)[1].split()
        if int(rest[1]) == launcher and rest[0] != "Z" and b"--id" in cmd:
            out[cmd[cmd.index(b"--id") + 1].decode()] = int(entry.name)
    return out


def announced(run_dir: Path) -> list[tuple[int, float]]:
    """(version, wall time it was recorded) of the primary policy, in order."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [(r["version"], r["ts"]) for r in rows if r["policy"] == "solver"]


def wait(cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


def up_cmd(run_dir: Path, steps: int, resume: bool = False) -> list[str]:
    base = [sys.executable, "-m", "astraflow.cli", "up"]
    if resume:
        return [*base, "--resume", str(run_dir), "--timeout", "900"]
    return [*base, str(ROOT / "recipes" / "arithmetic"), "--run-dir", str(run_dir), "--set", f"trainer.steps={steps}",
            "--set", "eval.every=1000", "--set", "plane.task_ack_wait=5", "--set", "plane.traj_ack_wait=5",
            "--set", "plane.batch_ack_wait=10", "--timeout", "900"]


def clean(work: Path, steps: int) -> dict[str, float]:
    run_dir = work / "clean"
    t0 = time.time()
    subprocess.run(up_cmd(run_dir, steps), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    vs = announced(run_dir)
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(vs)]
    return {"wall_s": time.time() - t0, "rl_s": vs[-1][1] - vs[0][1], "median_gap_s": statistics.median(gaps)}


def chaos(work: Path, steps: int, median_gap: float) -> dict[str, object]:
    run_dir = work / "chaos"
    t0 = time.time()
    launcher = subprocess.Popen(up_cmd(run_dir, steps), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kills = []
    try:
        wait(lambda: set(role_pids(launcher.pid)) >= set(ROLES), 120)
        wait(lambda: len(announced(run_dir)) >= 5, 300)
        for name in ROLES:
            wait(lambda: name in role_pids(launcher.pid), 60)
            before = announced(run_dir)[-1]
            old = role_pids(launcher.pid)[name]
            killed_at = time.time()
            os.kill(old, signal.SIGKILL)
            wait(lambda: role_pids(launcher.pid).get(name, old) != old, 60)
            restart = time.time() - killed_at
            wait(lambda: announced(run_dir)[-1][0] > before[0], 120)
            after = next(v for v in announced(run_dir) if v[0] == before[0] + 1)
            kills.append({"role": name, "restart_s": round(restart, 2),
                          "stall_s": round(max(0.0, after[1] - before[1] - median_gap), 2)})
            time.sleep(1.0)
        last = announced(run_dir)[-1]
        killed_at = time.time()
        launcher.kill()
        launcher.wait()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    resumed = subprocess.Popen(up_cmd(run_dir, steps, resume=True), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait(lambda: announced(run_dir)[-1][0] > last[0], 300)
    launcher_recovery = time.time() - killed_at
    resumed.wait(900)
    vs = [v for v, _ in announced(run_dir)]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"wall_s": time.time() - t0, "kills": kills, "launcher_recovery_s": round(launcher_recovery, 2),
            "versions_once": vs == list(range(steps + 1)), "adds_up": summary["accounting"]["solver"]["adds_up"],
            "restarts": summary["restarts"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = clean(work, args.steps)
        run = chaos(work, args.steps, base["median_gap_s"])
    console = Console()
    t = Table(title=f"kill -9 under astraflow up (arithmetic, {args.steps} steps)")
    for c in ("killed", "running again after", "training stalled"):
        t.add_column(c)
    for k in run["kills"]:  # type: ignore[union-attr]
        t.add_row(k["role"], f"{k['restart_s']:.1f} s", f"{k['stall_s']:.1f} s")
    t.add_row("launcher, then up --resume", f"{run['launcher_recovery_s']:.1f} s to the next version", "")
    console.print(t)
    stall = run["wall_s"] - base["wall_s"]
    console.print(f"clean run {base['wall_s']:.1f} s, chaos run {run['wall_s']:.1f} s (two sessions): total stall {stall:.1f} s; "
                  f"every version once: {run['versions_once']}; accounting adds up: {run['adds_up']}")
    print(json.dumps({"clean": base, "chaos": run, "total_stall_s": round(stall, 1)}))


if __name__ == "__main__":
    main()
