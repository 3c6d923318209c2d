"""Wall time and held-out reward of every CPU recipe, as shipped (or with --steps N), over one or more seeds.

Runs ``astraflow up recipes/NAME`` for each recipe (embedded server, every role a process) and reads its
summary, and the CPU time of every process of the run (user + system: a figure the load of a
shared machine does not inflate the way it does wall time). A recipe is a folder name or a file under ``recipes/``
(``code-multi-agent/verifier.yaml``).
With ``--seeds N`` each recipe runs N times (``model.seed`` and ``trainer.seed`` = 0..N-1) and the table
shows the mean and its 95 % t-interval over seeds (benchmarks/stats.py). ``--set a.b=v`` (repeatable) is
passed to every run (``--set eval.k=8``). With ``--figures DIR`` the first seed's ``reward.png`` of each recipe is
copied to ``DIR/recipe-NAME.png``. For a team recipe the table also shows the team's held-out reward
(the partner's pick of k samples) against the solver alone at the same k samples, and their difference
paired by seed (significant when its interval excludes 0). For an agent recipe it also counts the tool calls its
nodes read back and those that did not parse (the largest sums the live nodes reported, ``pool.jsonl``).

Run: ``python benchmarks/bench_recipes.py [--only search,terminal] [--steps N] [--seeds 3] [--set eval.k=8] [--figures DIR] [--keep DIR]``.
Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import over_seeds, paired

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ["arithmetic", "math", "math-multi-agent", "math-efficient-data", "search", "calculator", "calculator-agent", "alfworld",
           "webshop", "terminal", "code", "code-multi-agent", "code-multi-agent/verifier.yaml"]


def label(name: str) -> str:
    return name.replace("/", "-").removesuffix(".yaml")


def run(name: str, steps: int | None, seed: int, base: Path, overrides: list[str]) -> dict[str, Any]:
    run_dir = base / f"{label(name)}-s{seed}"
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(ROOT / "recipes" / name), "--run-dir", str(run_dir),
           "--set", f"model.seed={seed}", "--set", f"trainer.seed={seed}"]
    if steps:
        cmd += ["--set", f"trainer.steps={steps}"]
    for o in overrides:
        cmd += ["--set", o]
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)  # every process of the run (up reaps its roles)
    if proc.returncode:
        return {"recipe": name, "seed": seed, "ok": False, "wall_s": round(wall, 1), "error": proc.stderr[-300:]}
    s = json.loads((run_dir / "summary.json").read_text())
    if s["final_reward"] is None:  # stopped before its last evaluation
        return {"recipe": name, "seed": seed, "ok": False, "wall_s": round(wall, 1), "error": f"no final evaluation ({s['outcome']})"}
    team = s.get("held_out_others", {}).get("team", {})
    last = str(s["policies"][s["eval_policy"]]["steps"])
    pool = [json.loads(x) for x in (run_dir / "pool.jsonl").read_text().splitlines() if x.strip()]
    tools = {k: max((row.get(k, 0) for row in pool), default=0) for k in ("tool_calls", "tool_call_parse_failures")}
    return {"recipe": name, "seed": seed, "ok": True, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "run_dir": str(run_dir),
            "policies": list(s["policies"]), "steps": int(last), "held_out_initial": s["initial_reward"],
            "held_out_final": s["final_reward"], "held_out": s["held_out_reward"],
            "team": {v: (r["reward"], r["avg@k"]) for v, r in team.items()}, **tools,
            "partners": {p: rows for p, rows in s.get("held_out_others", {}).items() if p != "team"}}


def spread(values: list[float]) -> str:
    return over_seeds(values).fmt() if values else "—"


def difference(a: list[float], b: list[float]) -> str:
    if len(a) < 2:
        return "—"
    d = paired(a, b)
    return d.fmt(3) + (" *" if d.excludes_zero() else " (n.s.)")


def main() -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(RECIPES))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first..first+N-1")
    ap.add_argument("--figures", type=Path, default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="a.b=value for every run (repeatable)")
    ap.add_argument("--keep", type=Path, default=None, help="keep each run's folder (logs, metrics, batches) under this folder")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as d:
        base = args.keep or Path(d)
        for name in args.only.split(","):
            runs = [run(name, args.steps, seed, base, args.overrides) for seed in range(args.first_seed, args.first_seed + args.seeds)]
            if args.figures is not None and runs[0]["ok"]:
                args.figures.mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(runs[0]["run_dir"]) / "reward.png", args.figures / f"recipe-{label(name)}.png")
            results += runs
    t = Table(title="CPU recipes: wall time and held-out reward (greedy), mean ± 95 % t-interval over seeds")
    for c in ("recipe", "runs", "steps", "wall s", "CPU s", "held-out v0", "held-out final", "team final: pick / alone",
              "pick - alone (paired)", "tool calls (unparsed)"):
        t.add_column(c)
    for name in args.only.split(","):
        ok = [r for r in results if r["recipe"] == name and r["ok"]]
        team = [r["team"][str(r["steps"])] for r in ok if str(r["steps"]) in r["team"]]
        t.add_row(name, f"{len(ok)}/{args.seeds}", str(ok[0]["steps"]) if ok else "—", spread([r["wall_s"] for r in ok]),
                  spread([r["cpu_s"] for r in ok]),
                  spread([r["held_out_initial"] for r in ok]), spread([r["held_out_final"] for r in ok]),
                  f"{spread([p for p, _ in team])} / {spread([a for _, a in team])}" if team else "—",
                  difference([p for p, _ in team], [a for _, a in team]),
                  f"{sum(r['tool_calls'] for r in ok):.0f} ({sum(r['tool_call_parse_failures'] for r in ok):.0f})"
                  if any(r["tool_calls"] for r in ok) else "—")
    Console().print("* the paired interval excludes 0; n.s.: not significant at 95 %")
    Console().print(t)
    return results


if __name__ == "__main__":
    print(json.dumps(main()))
