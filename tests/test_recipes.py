"""Every shipped recipe loads (CPU and GPU configurations), and every CPU recipe runs briefly.

`arithmetic` (tests/test_end_to_end.py) and `math-multi-agent` (tests/test_workflows_multi.py)
are run at more length elsewhere; here each other CPU recipe (and `arithmetic/moe.yaml`, the
Mixture-of-Experts variant) runs two optimizer steps with
every role a process against the module's nats-server, and must announce versions 0..2 for
every policy and record held-out evaluations.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.config import load_recipe

ROOT = Path(__file__).resolve().parent.parent
ALL_YAML = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "recipes").glob("*/*.yaml"))
CPU_RECIPES = ["math", "math-efficient-data", "code", "code-multi-agent", "code-multi-agent/verifier.yaml", "search", "calculator",
               "calculator-agent", "alfworld", "webshop", "terminal", "arithmetic/moe.yaml"]


@pytest.mark.parametrize("path", ALL_YAML)
def test_recipe_loads(path: str):
    recipe = load_recipe(ROOT / path)
    if path.endswith("gpu.yaml"):  # GPU configurations name the real models of the seeds
        assert all(p.model.pretrained and p.model.pretrained.startswith("Qwen/Qwen3-") for p in recipe.policies.values())


def test_every_seed_recipe_is_shipped():
    for name in ("math", "math-multi-agent", "math-efficient-data", "code", "code-multi-agent", "search", "alfworld", "webshop",
                 "calculator", "terminal"):
        assert (ROOT / "recipes" / name / "recipe.yaml").exists() and (ROOT / "recipes" / name / "gpu.yaml").exists(), name


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_RECIPES)
def test_cpu_recipe_runs_briefly(name: str, nats_server, tmp_path):
    run_dir = tmp_path / f"{name.replace('/', '-').replace('.', '-')}-run"  # the run id comes from the folder name: no dots
    sets = ["trainer.steps=2", "eval.every=2", "rollout.nodes=1", "data.n_eval=16"]
    recipe = load_recipe(ROOT / "recipes" / name)
    if recipe.policies[recipe.primary].sft.steps:
        sets.append("sft.steps=10")
    if recipe.eval.k > 2:  # avg@k and pass@k still measured, on 2 samples a prompt rather than the recipe's 4 or 8
        sets.append("eval.k=2")
    # after 10 SFT steps every episode of these scores 0: their dynamic_sampling filter would keep no group
    if name in ("terminal", "alfworld") and recipe.dataflow.algorithms.filters:
        sets.append("dataflow.algorithms.filters=[]")
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(ROOT / "recipes" / name), "--nats", nats_server.url,
           "--run-dir", str(run_dir), "--timeout", "240", *(x for s in sets for x in ("--set", s))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    logs = (
        "".join(f"\n--- {p.name}\n" + p.read_text()[-1200:] for p in sorted((run_dir / "logs").glob("*.log")))
        if (run_dir / "logs").exists()
        else ""
    )
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:] + logs
    recipe = load_recipe(run_dir / "recipe.yaml")
    said = " ".join(proc.stdout.split())
    assert "every trainer is done: rollout-0 leave" in said, said[-1500:]  # the last evaluations have the cores
    if any(isinstance(cfg.trainer.cores, list) for cfg in recipe.policies.values()):  # a trainer held cores of its own:
        for role in ("dataflow", "rollout-0"):  # the others started anywhere and then kept to those left
            assert " on CPUs " in (run_dir / "logs" / f"{role}.s1.log").read_text(), role
        assert "the evaluator runs on CPUs" in said, said[-1500:]  # and once it was done, the evaluator took them all
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for policy in recipe.policy_names:
        assert [r["version"] for r in rows if r["policy"] == policy] == [0, 1, 2], policy
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["held_out_reward"]) == {"0", "2"}
    for subject, rows in summary["held_out_others"].items():  # a team's partner and the team itself
        assert set(rows) == {"0", "2"}, subject
    for policy, acc in summary["accounting"].items():  # the run's own nodes are honest: none of their claims is refused,
        assert not [f for f in acc["fates"] if f.startswith("invalid:")], (policy, acc["fates"])
    versions = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    suspects = {r["policy"]: r["logprob_gap_max"] for r in versions if r.get("suspect_trajectories")}
    assert not suspects, suspects  # and the trainer finds none of their tokens contradicted by the model
    for policy, cfg in recipe.policies.items():  # a recipe that asks for its MoE routing gets it, through the whole plane
        if cfg.trainer.routing != "own":
            steps = [r for r in versions if r["policy"] == policy and r["version"]]
            assert all("routing_mismatch" in r and r["routing_bytes"] > 0 for r in steps), policy


def test_loading_every_recipe_imports_no_model_stack():
    """Option models are resolved at load from light modules: no torch, no transformers, no engine or workflow code."""
    code = ("import sys, glob; from astraflow.config import load_recipe\n"
            "[load_recipe(p) for p in sorted(glob.glob('recipes/*/*.yaml'))]\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')"
            " or m.startswith(('astraflow.rollout.engines.', 'astraflow.rollout.workflows.', 'astraflow.train.losses.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True).stdout
    assert json.loads(out.replace("'", '"')) == ["astraflow.rollout.engines.options", "astraflow.rollout.workflows.options",
                                                 "astraflow.train.losses.options"]
