"""An agent learns its tool: the `calculator` recipe with every role a process, on a real nats-server.

The warm start imitates noisy demonstrations, most of which call the calculator on the product alone
and forget the addition, so the greedy held-out answer at v0 is wrong (v0 was 0.00 on every seed
tried). RL on the real verifier, with the tool output masked out of the loss, makes the agent call the
calculator on the whole expression and copy its result: held-out problems (triples never trained on)
go from ~0 to ~1 in ten steps. The margin asked for, 0.5 on 50 held-out problems, is far beyond what
evaluation noise can reach from a v0 of ~0.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_calculator_agent_learns_to_call_its_tool(nats_server, repo_root, tmp_path):
    run_dir = tmp_path / "calculator-run"
    sets = ["trainer.steps=10", "eval.every=10", "data.n_eval=50", "sft.steps=300", "rollout.nodes=1"]
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(repo_root / "recipes" / "calculator"), "--nats", nats_server.url,
           "--run-dir", str(run_dir), "--timeout", "420", *(x for s in sets for x in ("--set", s))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480)
    logs = (
        "".join(f"\n--- {p.name}\n" + p.read_text()[-1500:] for p in sorted((run_dir / "logs").glob("*.log")))
        if (run_dir / "logs").exists()
        else ""
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + logs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["initial_reward"] <= 0.2, summary  # the demonstrators' majority habit: the addition forgotten
    assert summary["final_reward"] >= summary["initial_reward"] + 0.5, summary
