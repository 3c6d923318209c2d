"""The plane's own processes killed under ``astraflow up``: the embedded nats-server (restarted by ``up`` on its address
with its store), and members of an embedded three-server cluster (``up --cluster 3``: every stream replicated on the
three), each beside a clean run of the same recipe on the same plane.

Per kill: how long training stalled (the longest gap between versions from the kill until the next one, minus the
clean run's median gap: a role may crash on a timeout seconds after the kill) and which roles the kill made the
supervisor restart (a role that crashes on a plane timeout is started
again and resumes from its durable state). Per run: every version announced once, the accounting adding up, held-out
v0 → last, wall time. Writes ``benchmarks/results/server_chaos.json``.

    python benchmarks/bench_server_chaos.py [--steps 120] [--kills 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from result_files import write  # noqa: E402


def servers_of(launcher: int) -> dict[int, str]:
    """The launcher's live nats-server children -> their name (``nats-server``, or ``nats-server-{i}`` in a cluster)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat[1]) == launcher and stat[0] != "Z" and b"nats-server" in cmd[0]:
                member = re.search(r"/cluster/n(\d+)/", cmd[2].decode())
                out[int(entry.name)] = f"nats-server-{member.group(1)}" if member else "nats-server"
    return out


def announced(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def wait(cond: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not get there in time")
        time.sleep(0.1)


def run(run_dir: Path, steps: int, cluster: int, kills: int, seed: int) -> dict[str, Any]:
    """One ``up`` of recipes/arithmetic; ``kills`` times, spread over the run, a server (a random member) killed."""
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(ROOT / "recipes" / "arithmetic"), "--run-dir", str(run_dir),
           "--cluster", str(cluster), "--set", f"trainer.steps={steps}", "--set", f"eval.every={steps // 4}", "--timeout", "1200"]
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "up.log", "wb") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    rng, killed = random.Random(seed), []

    def announced_or_ended(at: int) -> bool:
        if launcher.poll() is not None and len(announced(run_dir)) < at:
            raise RuntimeError(f"up ended ({launcher.returncode}) before v{at}: {(run_dir / 'up.log').read_text()[-2000:]}")
        return len(announced(run_dir)) >= at

    try:
        for k in range(kills):
            at = 3 + (k + 1) * (steps - 10) // (kills + 1)
            wait(lambda: announced_or_ended(at), 900)
            wait(lambda: len(servers_of(launcher.pid)) == cluster, 60)
            pid, name = rng.choice(sorted(servers_of(launcher.pid).items()))
            os.kill(pid, signal.SIGKILL)
            killed.append({"server": name, "at": time.time()})
        launcher.wait(timeout=1200)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = announced(run_dir)
    gaps = [b["ts"] - a["ts"] for a, b in itertools.pairwise(rows[1:])]  # v0 -> v1 waits for the nodes to start
    restarts = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()] if killed else []
    for i, k in enumerate(killed):  # the longest wait for a version from the kill until the next (roles crash later too)
        until = killed[i + 1]["at"] if i + 1 < len(killed) else float("inf")
        k["gap_s"] = round(max((b["ts"] - a["ts"] for a, b in itertools.pairwise(rows) if b["ts"] > k["at"] and a["ts"] < until),
                               default=0.0), 2)
        k["roles_restarted"] = sorted({r["role"] for r in restarts if k["at"] <= r["ts"] < until and not r["role"].startswith("nats")})
    acc = summary["accounting"]["solver"]
    return {"cluster": cluster, "kills": killed, "outcome": summary["outcome"], "wall_s": summary["wall_s"],
            "versions_once": [r["version"] for r in rows] == list(range(steps + 1)), "adds_up": acc["adds_up"],
            "median_gap_s": round(statistics.median(gaps), 3), "held_out_v0": summary["initial_reward"],
            "held_out_last": summary["held_out_reward"][str(steps)], "server_cpu_s": summary["cpu_s"].get("nats-server")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--kills", type=int, default=3)
    a = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-server-chaos-") as tmp:
        for cluster in (1, 3):
            clean = run(Path(tmp) / f"clean-{cluster}", a.steps, cluster, 0, 0)
            chaos = run(Path(tmp) / f"chaos-{cluster}", a.steps, cluster, a.kills, cluster)
            for k in chaos["kills"]:
                k["stall_s"] = round(max(0.0, k["gap_s"] - clean["median_gap_s"]), 2)
            runs += [clean, chaos]
            print(json.dumps(chaos), flush=True)
    t = Table(title=f"servers killed under up, {a.steps} steps")
    for c in ("plane", "killed", "stall", "roles restarted"):
        t.add_column(c)
    for r in runs:
        for k in r["kills"]:
            t.add_row("cluster of 3" if r["cluster"] == 3 else "one server", k["server"], f"{k['stall_s']:.1f} s",
                      ", ".join(k["roles_restarted"]) or "none")
    Console().print(t)
    write("server_chaos", {"steps": a.steps, "kills": a.kills, "runs": runs})


if __name__ == "__main__":
    main()
