"""Prometheus on rollout nodes and the evaluator, and the shipped Grafana dashboard / Prometheus config."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from astraflow.config import parse_recipe
from astraflow.metrics import Metrics, start_metrics_server
from astraflow.models import load_tokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.testing import ScriptEngine
from astraflow.rollout.evaluator import export_eval
from astraflow.rollout.node import RolloutNode
from astraflow.rollout.workflows.base import PolicyHandle

ROOT = Path(__file__).resolve().parent.parent
TOK = load_tokenizer("byt5")
# What the trainer's worker sets: its step metrics (torch backend) plus the worker's own keys.
TRAINER_GAUGES = ("version", "loss", "grad_norm", "reward_mean", "tokens", "tokens_per_s", "step_s", "wait_frac", "batch_wait_s")
TRAINER_COUNTERS = ("wait_seconds", "trained_tokens", "trained_batches", "redelivered_trained_batches")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


async def rollout_scrape(plane) -> tuple[str, int]:
    registry = CollectorRegistry()
    port = start_metrics_server(0, registry=registry, addr="127.0.0.1")
    recipe = parse_recipe({"name": "m", "policies": ["solver", "verifier"], "workflow": "solver_verifier"})
    handles = {p: PolicyHandle(ScriptEngine(TOK, lambda _: "4", version=3), TOK, SamplingParams(4), name=p)
               for p in ("solver", "verifier")}
    node = RolloutNode(recipe, plane, "node-7", handles=handles, metrics=Metrics("rollout", worker="node-7", registry=registry))
    node.report.export(node.draining)
    node.stats.update(tasks=4, trajectories=16, gen_s=1.5, refreshes=2, held=3)
    node.weights.syncs["solver"].stats["deltas"] += 2
    node.weights.syncs["solver"].stats["bytes"] += 1000
    node.report.export(node.draining)
    node.stats.update(tasks=5, trajectories=20)
    node.report.export(node.draining)  # counters advance by the difference, not the running total again
    return scrape(port), port


async def test_rollout_node_exports_stats_with_labels(plane):
    text, _ = await rollout_scrape(plane)
    node = '{policy="",worker="node-7"}'
    assert f"astraflow_rollout_tasks_total{node} 5.0" in text
    assert f"astraflow_rollout_trajectories_total{node} 20.0" in text
    assert f"astraflow_rollout_gen_seconds_total{node} 1.5" in text
    assert f"astraflow_rollout_refreshes_total{node} 2.0" in text
    assert f"astraflow_rollout_held{node} 3.0" in text
    solver, verifier = '{policy="solver",worker="node-7"}', '{policy="verifier",worker="node-7"}'
    assert f"astraflow_rollout_version{solver} 3.0" in text
    assert f"astraflow_rollout_version{verifier} 3.0" in text
    assert f"astraflow_rollout_weight_sync_deltas_total{solver} 2.0" in text
    assert f"astraflow_rollout_weight_sync_bytes_total{solver} 1000.0" in text
    assert f"astraflow_rollout_weight_sync_deltas_total{verifier} 0.0" in text  # exists before any sync


def test_evaluator_exports_last_evaluation():
    registry = CollectorRegistry()
    port = start_metrics_server(0, registry=registry, addr="127.0.0.1")
    export_eval(Metrics("evaluator", policy="solver", worker="evaluator", registry=registry),
                {"reward": 0.5, "avg@k": 0.25, "pass@k": 0.75, "k": 4.0, "n": 8.0}, 10, 10, 2.0)
    text = scrape(port)
    labels = '{policy="solver",worker="evaluator"}'
    for line in ("reward 0.5", "avg_at_k 0.25", "pass_at_k 0.75", "evaluated_version 10.0", "evaluations_total 1.0"):
        key, value = line.split()
        assert f"astraflow_evaluator_{key}{labels} {value}" in text


async def test_dashboard_uses_only_exported_metrics(plane):
    rollout, _ = await rollout_scrape(plane)
    registry = CollectorRegistry()
    port = start_metrics_server(0, registry=registry, addr="127.0.0.1")
    trainer = Metrics("trainer", policy="solver", worker="trainer-solver", registry=registry)
    trainer.set(dict.fromkeys(TRAINER_GAUGES, 1.0))
    trainer.inc(dict.fromkeys(TRAINER_COUNTERS, 1.0))
    export_eval(Metrics("evaluator", policy="solver", registry=registry), {"reward": 1, "avg@k": 1, "pass@k": 1, "k": 1}, 0, 0, 1)
    exported = names(rollout) | names(scrape(port))

    dash = json.loads((ROOT / "observability/grafana-dashboard.json").read_text())
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    used = {m for e in exprs for m in re.findall(r"\bastraflow_[a-zA-Z0-9_]+", e)}
    assert used and used <= exported, sorted(used - exported)
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("version", "loss", "reward", "grad norm", "tokens/s", "wait", "trajectories", "weight sync"):
        assert topic in titles
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_prometheus_config_parses():
    cfg = yaml.safe_load((ROOT / "observability/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert {"astraflow-trainer", "astraflow-rollout", "astraflow-evaluator", "astraflow-dataflow"} <= set(jobs)
    assert jobs["astraflow-rollout"]["file_sd_configs"]


@pytest.mark.slow
def test_up_serves_prometheus_from_every_role(nats_server, repo_root, tmp_path):
    """`up --metrics-port-base 0`: every role serves metrics on a free port (no port to race for), and the run
    directory lists them for Prometheus (file_sd); trainer, evaluator, dataflow and rollout nodes all answer a scrape."""
    import json
    import subprocess
    import sys
    import time
    import urllib.request

    run_dir = tmp_path / "prom-run"
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(repo_root / "recipes" / "arithmetic"), "--nats", nats_server.url,
           "--run-dir", str(run_dir), "--metrics-port-base", "0", "--timeout", "240",
           "--set", "trainer.steps=30", "--set", "sft.steps=10", "--set", "rollout.nodes=1", "--set", "eval.every=30"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    want = {"trainer": "astraflow_trainer_", "evaluator": "astraflow_evaluator_", "dataflow": "astraflow_dataflow_",
            "rollout": "astraflow_rollout_"}
    seen: dict[str, bool] = {}
    targets_file = run_dir / "prometheus_targets.json"
    try:
        deadline = time.monotonic() + 180
        while len(seen) < len(want) and time.monotonic() < deadline and proc.poll() is None:
            targets = json.loads(targets_file.read_text()) if targets_file.exists() else []
            for group in targets:
                role = group["labels"]["role"]
                if role in seen:
                    continue
                try:
                    body = urllib.request.urlopen(f"http://{group['targets'][0]}/metrics", timeout=2).read().decode()
                except OSError:
                    continue
                if want[role] in body and f'worker="{group["labels"]["worker"]}"' in body:
                    seen[role] = True
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(60)
    assert set(seen) == set(want), f"no metrics from {[r for r in want if r not in seen]}"
