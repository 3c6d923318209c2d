"""The end of every session: ``summary.json``, ``reward.png`` and CSVs, from the run directory's records (the whole run)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from astraflow.config import Recipe
from astraflow.launch.rundir import RunDir


def summarize(recipe: Recipe, rundir: RunDir, console: Console, outcome: str = "finished") -> dict[str, Any]:
    versions = list(rundir.rows("metrics.jsonl"))
    evals = {int(r["version"]): r for r in rundir.rows("evals.jsonl") if r.get("policy") == recipe.eval_policy}
    others: dict[str, dict[int, dict[str, Any]]] = {}  # a team's other subjects (its partner policies, the team)
    for r in rundir.rows("evals.jsonl"):
        if r.get("policy") != recipe.eval_policy:
            others.setdefault(r["policy"], {})[int(r["version"])] = r
    per_policy = {}
    for p, cfg in recipe.policies.items():
        rows = sorted((r for r in versions if r["policy"] == p), key=lambda r: r["version"])
        deltas = [r["bytes"] for r in rows if r["encoding"] == "delta"]
        last5 = rows[-5:]
        per_policy[p] = {
            "steps": cfg.trainer.steps, "versions": len(rows),
            "train_reward_last5": sum(r.get("reward_mean", 0.0) for r in last5) / max(1, len(last5)),
            "keyframe_bytes": max((r["bytes"] for r in rows if r["encoding"] == "keyframe"), default=0),
            "delta_bytes_mean": sum(deltas) / max(1, len(deltas)),
        }
    sessions = rundir.sessions()
    restarts: dict[str, int] = {}
    for r in rundir.rows("restarts.jsonl"):  # recorded as they happen: a session whose launcher was killed counts too
        restarts[r["role"]] = restarts.get(r["role"], 0) + 1
    final_v = recipe.policies[recipe.eval_policy].trainer.steps
    summary = {
        "recipe": recipe.name, "outcome": outcome, "wall_s": round(rundir.wall_s(), 1), "sessions": len(sessions),
        "restarts": restarts, "eval_policy": recipe.eval_policy,
        "held_out_reward": {str(v): r["reward"] for v, r in sorted(evals.items())},
        "initial_reward": evals[0]["reward"] if 0 in evals else None,
        "final_reward": evals[final_v]["reward"] if final_v in evals else None,
        "held_out_others": {subject: {str(v): {k: r[k] for k in ("reward", "avg@k", "pass@k")} for v, r in sorted(rows.items())}
                            for subject, rows in others.items()},
        "eval_at_s": {str(v): r["run_s"] for v, r in sorted(evals.items())},
        "eval_at_rollouts": {str(v): r["rollouts"] for v, r in sorted(evals.items())},
        "policies": per_policy,
        "accounting": json.loads(rundir.file("accounting.json").read_text()) if rundir.file("accounting.json").exists() else {},
    }
    rundir.file("summary.json").write_text(json.dumps(summary, indent=2))
    pool = list(rundir.rows("pool.jsonl"))
    plot(versions, list(evals.values()), pool, rundir.file("reward.png"), recipe.name, others)
    write_csv(versions, rundir.file("metrics.csv"))
    write_csv(pool, rundir.file("pool.csv"))
    t = Table(title=f"{recipe.name}: summary")
    t.add_column("metric")
    t.add_column("value")
    for k, v in summary.items():
        t.add_row(k, json.dumps(v) if not isinstance(v, float) else f"{v:.3f}")
    console.print(t)
    console.print(f"run directory: {rundir.path}")
    return summary


def plot(versions: list[dict[str, Any]], evals: list[dict[str, Any]], pool: list[dict[str, Any]], path: Path, title: str,
         others: dict[str, dict[int, dict[str, Any]]] | None = None) -> None:
    """Four panels: reward against version (with a team's other held-out subjects); held-out reward against
    rollouts generated (when each evaluated version was trained); trainer wait; pool throughput and size, over run time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    (a, b), (c, d) = axes
    for p in dict.fromkeys(r["policy"] for r in versions):
        rows = sorted((r for r in versions if r["policy"] == p and "reward_mean" in r), key=lambda r: r["version"])
        a.plot([r["version"] for r in rows], [r["reward_mean"] for r in rows], label=f"{p}: train reward (batch mean)", alpha=0.7)
    ev = sorted(evals, key=lambda r: r["version"])
    if ev:
        a.plot([r["version"] for r in ev], [r["reward"] for r in ev], "o-", label="held-out reward (greedy)")
        b.plot([r["rollouts"] for r in ev], [r["reward"] for r in ev], "o-", color="C3")
    for subject, by_version in (others or {}).items():
        vs = sorted(by_version)
        a.plot(vs, [by_version[v]["reward"] for v in vs], "s-", label=f"held-out: {subject}")
        if subject == "team":  # what the team picks out of k samples, against one of them at random
            a.plot(vs, [by_version[v]["avg@k"] for v in vs], "s--", label="held-out: solver alone at the same k (avg@k)")
    a.set(xlabel="policy version (optimizer steps)", ylabel="reward", ylim=(-0.02, 1.02), title="reward")
    b.set(xlabel="rollouts generated", ylabel="held-out reward", ylim=(-0.02, 1.02), title="held-out reward vs rollouts")
    for key in sorted({k for s in pool for k in s if k.startswith("wait.")}):
        rows = [s for s in pool if key in s]  # from the trainer's first heartbeat on
        c.plot([s["run_s"] for s in rows], [s[key] for s in rows], label=f"trainer {key[5:]}")
    c.set(xlabel="run time (s)", ylabel="fraction of wall time", ylim=(-0.02, 1.02), title="trainer waiting for data")
    ts = [s["run_s"] for s in pool]
    d.plot(ts, [s.get("rate", 0.0) for s in pool], label="trajectories / s (stored)")
    d2 = d.twinx()
    d2.step(ts, [s.get("nodes", 0) for s in pool], color="C2", where="post", label="live rollout nodes")
    d2.set_ylabel("nodes")
    d.set(xlabel="run time (s)", ylabel="trajectories / s", title="pool throughput")
    lines, labels = d.get_legend_handles_labels()
    lines2, labels2 = d2.get_legend_handles_labels()
    if lines or lines2:
        d.legend(lines + lines2, labels + labels2, fontsize=8, loc="upper left")
    for ax in (a, c):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (list, dict))))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
