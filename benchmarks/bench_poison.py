"""The poison campaign: live ``astraflow up recipes/arithmetic`` runs under attack, side by side with clean runs
of the same recipe on the same machine.

Each poisoned run injects ``--per-field`` property-generated poisons per field of every message type
(``tests/poison.py``) through a rollout credential and through the admin credential, plus the
stale-redelivery and bare-trainer scenarios (``tests/poison_run.py``, the same code as
``tests/test_poison.py``, which runs a short campaign). Printed: poisons tried and caught per kind and
field, and per run whether it was corrupted (goal: 0). A run counts as corrupted when any of these
fails: it finished; no role restarted; every version announced exactly once; every poison in the DLQ
with the reason its check gives; the accounting adds up; every number in the summary finite; what
the permissions refuse a node was refused; the bare trainer refused; the stolen batch was dropped as
stale; held-out reward at least the clean runs' lowest minus ``--margin``.

    python benchmarks/bench_poison.py [--clean 3] [--runs 2] [--per-field 6] [--steps 150]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from poison_run import (  # noqa: E402
    Campaign,
    admin_attack,
    connect,
    finite_summary,
    rollout_attack,
    secured_server,
    stale_rejection,
    start_up,
    steal_a_batch,
    until,
    verdict,
    versions,
)

from astraflow.config import load_recipe  # noqa: E402
from astraflow.streams.messages import Rejected  # noqa: E402

CAUGHT_BY = {  # kind -> whose check catches it, and how it shows
    "trajectory": "dataflow: dlq.traj, fate invalid:R (outside the wire's range: the codec, fate invalid:schema)",
    "task": "rollout node: dlq.task (a task never issued: dataflow, dlq.traj)",
    "batch": "trainer: dlq.batch (the manifest, then the trajectories fetched by sequence)",
    "weights": "nodes, evaluator, launcher: dlq.weights; dataflow ignores; trainer steps over",
    "heartbeat": "not dead-lettered (liveness): autoscale advice stays finite",
    "keyframe_request": "not dead-lettered (run state): trainer only makes keyframes",
    "rejected": "not dead-lettered (a DLQ entry): dataflow ignores what is not its in-flight task",
}


def live_run(base: Path, steps: int, per_field: int | None, at: int) -> dict[str, Any]:
    """One run (clean when ``per_field`` is None); what it reported and, under attack, what the campaign found."""
    run = ("poison" if per_field else "clean") + uuid.uuid4().hex[:6]
    tmp = base / run
    tmp.mkdir()
    run_dir = tmp / run
    server, cred_dir = secured_server(tmp, run)
    sets = {"trainer.steps": steps, "eval.every": steps, "plane.batch_ack_wait": 10,
            "dataflow.quarantine_after": 0}  # every poison judged by its own check (quarantine: bench_hostile_node.py)
    up = start_up(run_dir, server.url, cred_dir, sets, tmp / "up.log")
    camp, judged, stale, t0, error = Campaign(), None, None, time.monotonic(), ""
    try:
        if per_field:
            async def attack() -> None:
                async def training() -> bool:
                    return len(versions(run_dir)) >= 3

                await until(training, "training to start", 600)
                recipe = load_recipe(run_dir / "recipe.yaml")
                await steal_a_batch(cred_dir, run, recipe, camp)
                await asyncio.gather(rollout_attack(cred_dir, run, recipe, per_field, at, camp),
                                     admin_attack(cred_dir, run, recipe, run_dir, per_field, at + 1, camp))

            try:
                asyncio.run(attack())
            except Exception as e:  # the attacker's failure, not the run's: reported, the run still judged
                error = f"{type(e).__name__}: {e}"
        code = up.wait(timeout=1800)
        if per_field:
            judged = asyncio.run(verdict(cred_dir, run, camp))

            async def dlq_batches() -> list[Rejected]:
                plane = await connect(cred_dir, "admin", run)
                try:
                    return await plane.history(plane.names.dlq("batch"), Rejected)
                finally:
                    await plane.close()

            stale = stale_rejection(asyncio.run(dlq_batches()), camp.stolen_batch)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        server.stop()
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    acc = summary.get("accounting", {}).get("solver", {})
    checks = {
        "finished": code == 0 and summary.get("outcome") == "finished",
        "no restarts": summary.get("restarts") == {},
        "versions once": versions(run_dir) == list(range(steps + 1)),
        "accounting adds up": bool(acc.get("adds_up")),
        "summary finite": finite_summary(summary),
    }
    if per_field:
        assert judged is not None
        checks["attack ran"] = not error
        checks |= {"every poison dead-lettered": not judged.missed, "permissions refused": bool(camp.denied) and all(camp.denied.values()),
                   "bare trainer refused": camp.rogue_trainer[0] != 0 and "--fresh-lineage" in camp.rogue_trainer[1],
                   "stolen batch stale": stale is not None and stale.startswith("stale: ")}
    result = {"run": run, "wall_s": round(time.monotonic() - t0, 1), "final": summary.get("final_reward"), "checks": checks,
              "tried": judged.tried if judged else Counter(), "caught": judged.caught if judged else Counter(),
              "missed": judged.missed if judged else [], "unjudged": Counter(p.name for p in camp.unjudged), "fates": acc.get("fates", {}),
              "denied": camp.denied, "error": error}
    print(json.dumps(result), flush=True)  # each run as it ends: a campaign cut short keeps what it measured
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clean", type=int, default=3, help="clean runs (the held-out reward's spread)")
    ap.add_argument("--runs", type=int, default=2, help="poisoned runs (each with its own seed)")
    ap.add_argument("--per-field", type=int, default=6, help="poisons per field of every message type, per attacker and run")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--margin", type=float, default=0.15, help="held-out reward a poisoned run may lose against the clean runs' lowest")
    a = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="bench-poison-") as tmp:
        clean = [live_run(Path(tmp), a.steps, None, 0) for _ in range(a.clean)]
        poisoned = [live_run(Path(tmp), a.steps, a.per_field, 10 * (i + 1)) for i in range(a.runs)]
    finals = [r["final"] for r in clean if r["final"] is not None]
    floor = (min(finals) if finals else 0.0) - a.margin
    for r in poisoned:
        r["checks"]["held-out within noise"] = r["final"] is not None and r["final"] >= floor

    tried, caught, unjudged, denied = Counter[str](), Counter[str](), Counter[str](), Counter[str]()
    for r in poisoned:
        tried.update(r["tried"])
        caught.update(r["caught"])
        unjudged.update(r["unjudged"])
        denied.update({k: int(ok) for k, ok in r["denied"].items()})
    t = Table(title=f"poisoned messages ({a.runs} runs, {a.per_field} per field and attacker, seeded)")
    for c in ("kind.field", "tried", "caught", "by"):
        t.add_column(c, justify="right" if c in ("tried", "caught") else "left")
    for name in sorted(tried):
        t.add_row(name, str(tried[name]), str(caught[name]), CAUGHT_BY[name.split(".")[0]])
    for name in sorted(unjudged):
        t.add_row(name, str(unjudged[name]), "-", CAUGHT_BY[name.split(".")[0]])
    for name in sorted(denied):
        t.add_row(f"rollout may not: {name}", str(len(poisoned)), str(denied[name]), "the server's permissions (refused, never stored)")
    t.add_row("total", str(sum(tried.values()) + sum(unjudged.values()) + len(poisoned) * len(denied)),
              str(sum(caught.values()) + sum(denied.values())), "")
    console.print(t)

    t = Table(title="runs")
    for c in ("run", "kind", "wall s", "held-out at end", "corrupted", "failed checks"):
        t.add_column(c)
    for r in clean:
        failed = [k for k, ok in r["checks"].items() if not ok]
        t.add_row(r["run"], "clean", str(r["wall_s"]), f"{r['final']}", "yes" if failed else "no", ", ".join(failed))
    for r in poisoned:
        failed = [k for k, ok in r["checks"].items() if not ok]
        t.add_row(r["run"], "poisoned", str(r["wall_s"]), f"{r['final']}", "yes" if failed else "no", ", ".join(failed))
    console.print(t)
    if finals:
        console.print(f"clean held-out at v{a.steps}: min {min(finals):.2f}, mean {statistics.mean(finals):.2f}, max {max(finals):.2f}; "
                      f"floor for poisoned runs {floor:.2f}")
    corrupted = sum(any(not ok for ok in r["checks"].values()) for r in poisoned)
    console.print(f"runs corrupted: {corrupted} of {len(poisoned)} (goal 0)")
    for r in poisoned:
        for m in r["missed"]:
            console.print(f"  missed in {r['run']}: {m}")
        console.print(f"  fates of {r['run']}: {r['fates']}")


if __name__ == "__main__":
    main()
