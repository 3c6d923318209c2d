"""A node that lies, against live ``astraflow up recipes/arithmetic`` runs (the embedded server): clean runs; runs with
the lying node where the dataflow believes what nodes claim (``dataflow.trust_claims=true``: how every run was before
the claim checks); runs with the claim checks on and no quarantine (``dataflow.quarantine_after=0``); runs as
shipped, where the node is quarantined and cut off; and runs as shipped where the node tells only the lie no check of
the dataflow can see (true claims, made-up logprobs), so that only the trainer's token check, counted against the node,
cuts it off. The same seeds for each.

The lying node (``tests/hostile.py``) holds a node credential the operator issued it (``astraflow node add``). Once
training has started it pulls real tasks from the pool for ``--lie-s`` seconds (or until it is cut off) and answers
every other one with well-formed lies: true claims with made-up behaviour logprobs (for the trainer's check of tokens
against the model), random completion tokens claiming reward 1 for half the group, answers to a prompt of its own
choosing, and rewards of 1e29.

Reported per run: held-out reward (mean of the last five evaluations), lies told, lies that broke a claim and were
trained (goal 0 with the checks), honest trajectories refused (goal 0), trajectories the trainer left out as suspect
and the largest logprob gap of any step (``metrics.jsonl``), the largest batch reward mean; for the shipped runs, the
time from the first lie to the quarantine and from the quarantine to the node's connection closed; and what the
claim checks cost per trajectory (``ClaimCheck.cost``). Writes ``benchmarks/results/hostile_node.json``.

    python benchmarks/bench_hostile_node.py [--seeds 2] [--steps 300] [--lie-s 60]
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from hostile import CLAIMS, Lies, attack, start_up  # noqa: E402
from result_files import write  # noqa: E402

MODES = ("clean", "lying, claims believed", "lying, claims checked", "lying, node quarantined",
         "only made-up logprobs, node quarantined")
KINDS = {MODES[4]: ("logprobs",)}  # the lies a mode's node tells (default: every kind, in turn)
SETS = {MODES[1]: {"dataflow.trust_claims": "true", "dataflow.quarantine_after": 0}, MODES[2]: {"dataflow.quarantine_after": 0}}


def held_out_last5(summary: dict[str, Any]) -> float:
    curve = sorted((int(v), r) for v, r in summary["held_out_reward"].items())
    return statistics.mean(r for _, r in curve[-5:])


def live_run(base: Path, mode: str, seed: int, steps: int, lie_s: float) -> dict[str, Any]:
    run = "hostile" + uuid.uuid4().hex[:6]
    tmp = base / run
    tmp.mkdir()
    run_dir = tmp / run
    sets: dict[str, Any] = {"trainer.steps": steps, "eval.every": 20, "trainer.seed": seed, **SETS.get(mode, {})}
    up = start_up(run_dir, sets, tmp / "up.log", timeout=3600)
    lies, fates, t0 = Lies(**({"kinds": KINDS[mode]} if mode in KINDS else {})), {}, time.monotonic()
    try:
        if mode != MODES[0]:
            fates = asyncio.run(attack(up, run_dir, lie_s, lies, seed, timeout=3600))
        code = up.wait(timeout=3600)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]["solver"]
    lie_fates = Counter(fates.values())
    broken = Counter(fates[t] for t, kind in lies.told.items() if kind in CLAIMS)
    invalid = sum(n for f, n in acc["fates"].items() if f.startswith("invalid:"))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    out = {"mode": mode, "seed": seed, "finished": code == 0 and summary.get("outcome") == "finished",
           "wall_s": round(time.monotonic() - t0, 1), "held_out_v0": summary["initial_reward"],
           "held_out_last5": round(held_out_last5(summary), 4), "lies_told": len(lies.told), "lies_trained": broken.get("trained", 0),
           "lie_fates": dict(lie_fates), "honest_refused": invalid - sum(n for f, n in lie_fates.items() if f.startswith("invalid:")),
           "suspect_trajectories": int(sum(r.get("suspect_trajectories", 0) for r in rows)),
           "logprob_gap_max": round(max((r.get("logprob_gap_max", 0.0) for r in rows), default=0.0), 3),
           "max_batch_reward_mean": max((r.get("reward_mean", 0.0) for r in rows), default=0.0), "fates": acc["fates"],
           "adds_up": acc["adds_up"]}
    if lies.quarantine is not None:  # seconds from the first lie to the quarantine, and on to the node's connection closed
        out["quarantine_s"] = round(lies.quarantine.at - lies.started, 2)
        out["cut_off_s"] = round(lies.cut_off - lies.quarantine.at, 2) if lies.cut_off is not None else None
        out["refused_as_quarantined"] = lie_fates.get("invalid:quarantined", 0)
    print(json.dumps(out), flush=True)
    return out


def claim_cost(n: int = 400) -> dict[str, float]:
    """Per-trajectory cost of the claim checks (µs) on honest answers to arithmetic prompts, under the ``arithmetic``
    reward (exact match) and the ``math`` reward (math-verify), as the ``arithmetic`` and ``math`` recipes score them."""
    import numpy as np

    from astraflow.config import parse_recipe
    from astraflow.dataflow.claims import ClaimCheck
    from astraflow.models import encode_prompt, load_tokenizer
    from astraflow.streams.messages import Trajectory
    from astraflow.tasks import load_split

    tok = load_tokenizer("byt5")
    out = {}
    for reward in ("arithmetic", "math"):
        r = parse_recipe({"name": "c", "policies": ["solver"], "reward": reward, "data": {"n_train": n, "n_eval": 10}})
        train, _ = load_split(r.data)
        check = ClaimCheck(r, train)
        items = []
        for k, p in enumerate(train):
            ids = np.asarray(encode_prompt(tok, p.meta["answer"]), "<i4")
            items.append((Trajectory(traj_id=f"t{k:08d}.solver.0", task_id=f"t{k:08d}", prompt_id=p.prompt_id, policy="solver", index=0,
                                     group_size=r.dataflow.group_size, prompt_ids=np.asarray(encode_prompt(tok, p.prompt), "<i4"),
                                     completion_ids=ids, logprobs=np.full(len(ids), -0.5, "<f4"), versions=np.zeros(len(ids), "<i4"),
                                     loss_mask=np.ones(len(ids), "<u1"), reward=1.0), p.prompt_id))
        check.check_all(items[:20])  # warm: math-verify's first parse builds its grammar
        start = time.perf_counter()
        found = check.check_all(items)
        assert not any(found), [f for f in found if f][:3]  # honest answers: none refused
        out[reward] = round(1e6 * (time.perf_counter() - start) / len(items), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lie-s", type=float, default=60.0)
    a = ap.parse_args()
    console = Console()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        for seed in range(a.seeds):
            for mode in MODES:
                runs.append(live_run(Path(tmp), mode, seed, a.steps, a.lie_s))
    cost = claim_cost()
    t = Table(title=f"a lying node, {a.steps} steps, lying for {a.lie_s:.0f} s")
    for c in ("mode", "seed", "held-out v0", "held-out (last 5)", "lies told", "claim lies trained", "honest refused", "suspects",
              "max gap", "max batch reward", "quarantined after", "cut off after"):
        t.add_column(c)
    for r in runs:
        t.add_row(r["mode"], str(r["seed"]), f"{r['held_out_v0']:.3f}", f"{r['held_out_last5']:.3f}", str(r["lies_told"]),
                  str(r["lies_trained"]), str(r["honest_refused"]), str(r["suspect_trajectories"]), f"{r['logprob_gap_max']:.2f}",
                  f"{r['max_batch_reward_mean']:.3g}", f"{r['quarantine_s']} s" if "quarantine_s" in r else "",
                  f"{r['cut_off_s']} s" if r.get("cut_off_s") is not None else "")
    console.print(t)
    console.print(f"claim checks per trajectory: {cost}")
    means = {m: statistics.mean(r["held_out_last5"] for r in runs if r["mode"] == m) for m in MODES}
    write("hostile_node", {"steps": a.steps, "lie_s": a.lie_s, "runs": runs, "held_out_last5_mean": means, "claim_check_us": cost})


if __name__ == "__main__":
    main()
