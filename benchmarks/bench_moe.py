"""Mixture-of-Experts against dense on live ``astraflow up recipes/arithmetic`` runs: the routing mismatch, and what
routing replay changes.

**Mismatch.** One ``moe.yaml`` run per expert count (``--experts``; top-2, each expert as wide as the recipe's) with
``trainer.routing: measured``, and one dense run. The last checkpoint of each is then read the two ways the run
reads it: as a node holds it (the announced bf16 image in an ``hf`` engine that records routing, computing in fp32 as
a CPU node does, and in bf16 as a GPU engine does) and as the trainer does (its fp32 weights). The engine samples
``--samples`` completions of every held-out prompt; at that same version the trainer's forward gives the share of
(position, layer) routes whose top-k set differs, and the mean |log π_trainer − log π_engine| per completion token,
with its own routing and with the engine's replayed. The runs' own metrics add the share during training
(staleness included).

**Learning.** ``--seeds`` seeds of dense, MoE (routing measured, the trainer's own), MoE with routing replay, and
both again with nodes computing in bf16 (``rollout.engine.dtype``), the recipe's 80 steps each. A seed sets the
split, the initial weights and the sampling, so seed for seed the runs share a warm start. Reported: held-out v0,
the last evaluation, the mean of the last five, the rise; the trainer's median step; the routing's bytes per
trajectory. ``--variant "label:key=value,…"`` adds MoE runs with other settings. Writes
``benchmarks/results/moe.json`` and ``benchmarks/figures/moe-learning.png``.

    python benchmarks/bench_moe.py [--seeds 6] [--experts 4 8 16 32] [--variant "MoE, unrouted step:trainer.unrouted_experts=step"]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from result_files import write  # noqa: E402
from stats import over_seeds, paired  # noqa: E402

from astraflow.config import load_recipe  # noqa: E402
from astraflow.models import build_model, encode_prompt, load_tokenizer  # noqa: E402
from astraflow.moe_routing import routed, routing_shape  # noqa: E402
from astraflow.rollout.engines.base import GenerationRequest, SamplingParams  # noqa: E402
from astraflow.rollout.engines.hf import HFEngine  # noqa: E402
from astraflow.rollout.workflows.base import make_trajectory  # noqa: E402
from astraflow.streams.messages import Batch, Task, TrajRef  # noqa: E402
from astraflow.streams.trajectories import TrainingBatch  # noqa: E402
from astraflow.tasks import load_split  # noqa: E402
from astraflow.train.batching import to_tensors  # noqa: E402
from astraflow.train.losses.functional import gather_logprobs  # noqa: E402

RECIPES = {"dense": ROOT / "recipes" / "arithmetic", "MoE": ROOT / "recipes" / "arithmetic" / "moe.yaml"}
BF16_NODES = {"rollout.engine.dtype": "bfloat16"}
CONFIGS = {"dense": ("dense", {}), "MoE": ("MoE", {"trainer.routing": "measured"}),
           "MoE, routing replay": ("MoE", {"trainer.routing": "replayed"}),
           "MoE, bf16 nodes": ("MoE", {**BF16_NODES, "trainer.routing": "measured"}),
           "MoE, bf16 nodes, routing replay": ("MoE", {**BF16_NODES, "trainer.routing": "replayed"})}
PAIRS = {"replay − own": ("MoE, routing replay", "MoE"),
         "replay − own, bf16 nodes": ("MoE, bf16 nodes, routing replay", "MoE, bf16 nodes")}


def up(recipe: Path, run_dir: Path, sets: dict[str, Any]) -> dict[str, Any]:
    """One ``astraflow up`` run: its summary, metrics and held-out curve."""
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(recipe), "--run-dir", str(run_dir),
           *(x for k, v in sets.items() for x in ("--set", f"{k}={v}"))]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=3600)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    curve = sorted((int(v), r) for v, r in summary["held_out_reward"].items())
    return {"summary": summary, "steps": [r for r in rows if "step_s" in r], "curve": curve}


def learning_run(base: Path, config: str, base_recipe: str, sets: dict[str, Any], seed: int) -> dict[str, Any]:
    run = up(RECIPES[base_recipe], base / f"{config.replace(' ', '_').replace(',', '')}-{seed}",
             {**sets, "model.seed": seed, "trainer.seed": seed, "data.seed": seed})
    curve, steps = run["curve"], run["steps"]
    out = {"config": config, "seed": seed, "held_out_v0": curve[0][1], "held_out_last": curve[-1][1],
           "held_out_last5": round(statistics.mean(r for _, r in curve[-5:]), 4), "curve": curve,
           "step_s_median": round(statistics.median(r["step_s"] for r in steps), 4),
           "logprob_gap_mean": round(statistics.mean(r["logprob_gap_mean"] for r in steps), 5),
           "wall_s": run["summary"]["wall_s"]}
    out["rise"] = round(out["held_out_last5"] - out["held_out_v0"], 4)
    if any("routing_mismatch" in r for r in steps):
        out["routing_mismatch_training"] = round(statistics.mean(r["routing_mismatch"] for r in steps), 5)
        out["routing_bytes"] = round(statistics.mean(r["routing_bytes"] for r in steps), 1)
    print(json.dumps({k: v for k, v in out.items() if k != "curve"}), flush=True)
    return out


@torch.no_grad()
def same_version(run_dir: Path, recipe_path: Path, sets: dict[str, Any], samples: int) -> dict[str, float]:
    """The last checkpoint read as a node holds it (bf16 image, hf engine recording routing) and as the trainer does
    (fp32): the share of routes whose top-k differs and the mean |Δ logprob| per token, own routing and replayed."""
    recipe = load_recipe(recipe_path, [f"{k}={v}" for k, v in sets.items()])
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer(pcfg.model.tokenizer)
    last = sorted((run_dir / "checkpoints" / "solver").glob("v*"))[-1]
    trainer = build_model(pcfg.model, tok).eval()
    load_model(trainer, str(last / "model.safetensors"))
    state = {k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()}
    _, held_out = load_split(recipe.data)
    prompts = [encode_prompt(tok, p.prompt) for p in held_out]
    out: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):  # a CPU node computes in the model's fp32; a GPU engine in bf16
        engine = HFEngine(build_model(pcfg.model, tok).to(dtype), tok)
        engine.load_state(state, int(last.name[1:]))
        suffix = "" if dtype == torch.float32 else "_bf16"
        out |= {f"{k}{suffix}": v for k, v in against_trainer(trainer, engine, prompts, samples, recipe, tok).items()}
    return out


def against_trainer(trainer: Any, engine: HFEngine, prompts: list[list[int]], samples: int, recipe: Any, tok: Any) -> dict[str, float]:
    """``engine`` samples every prompt ``samples`` times; the trainer's forward reads the completions with its own
    routing and the engine's replayed."""
    moe = recipe.policies["solver"].model.arch == "qwen3_moe"
    if moe:
        engine.record_routing()
    params = SamplingParams(recipe.rollout.max_new_tokens, recipe.rollout.temperature)
    comps = engine.generate([GenerationRequest(p, params) for p in prompts for _ in range(samples)])
    task = Task(task_id="t", workflow="single_turn", policy="solver", prompt_id="p", prompt="-", group_size=len(comps))
    trajs = [make_trajectory(task, "solver", i, len(comps), prompts[i // samples], c.token_ids, c.logprobs, c.versions, None,
                             0.0, c.finish_reason, "bench", routing=c.routing) for i, c in enumerate(comps)]
    manifest = Batch(batch_id="solver-bench", policy="solver", task_ids=["t"], advantages=np.zeros(len(trajs), "<f4").tobytes(),
                     refs=[TrajRef(seq=i + 1, traj_id=t.traj_id, task_id="t") for i, t in enumerate(trajs)])
    x = to_tensors(TrainingBatch(manifest, trajs), tok.pad_token_id, routing=routing_shape(trainer) if moe else None)
    out: dict[str, float] = {}
    for name, replay in (("own", False), ("replayed", True)) if moe else (("own", False),):
        with routed(trainer, x.routing, replay) as counts:
            logits = trainer(input_ids=x.input_ids, attention_mask=x.attention_mask, use_cache=False).logits
        lp = gather_logprobs(logits[torch.arange(len(trajs))[:, None], x.logit_index] / params.temperature, x.targets)
        gap = ((lp - x.behave_logprobs).abs() * x.mask).sum() / x.mask.sum()
        out[f"logprob_gap_{name}"] = round(float(gap), 6)
        if counts is not None and not replay:
            out["routing_mismatch"] = round(counts.share(), 6)
            out["routes"] = int(counts.recorded)
    out["tokens"] = int(x.mask.sum())
    return out


def mismatch_sweep(base: Path, experts: list[int], samples: int) -> list[dict[str, Any]]:
    rows = []
    dense_dir = base / "sweep-dense"
    run = up(RECIPES["dense"], dense_dir, {})
    rows.append({"model": "dense", "experts": 0, **same_version(dense_dir, RECIPES["dense"], {}, samples),
                 "logprob_gap_training": round(statistics.mean(r["logprob_gap_mean"] for r in run["steps"]), 5)})
    for e in experts:
        sets = {"model.num_experts": e, "trainer.routing": "measured"}
        run_dir = base / f"sweep-{e}"
        run = up(RECIPES["MoE"], run_dir, sets)
        rows.append({"model": f"MoE, {e} experts", "experts": e, **same_version(run_dir, RECIPES["MoE"], sets, samples),
                     "routing_mismatch_training": round(statistics.mean(r["routing_mismatch"] for r in run["steps"]), 5),
                     "logprob_gap_training": round(statistics.mean(r["logprob_gap_mean"] for r in run["steps"]), 5)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Held-out against version (mean over seeds), and its rise over each run's own v0 (mean, 95 % interval): the warm
    start differs more from seed to seed than the configurations do."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for i, config in enumerate(dict.fromkeys(r["config"] for r in runs)):
        curves = [r["curve"] for r in runs if r["config"] == config]
        versions = [v for v, _ in curves[0]]
        values = np.array([[r for _, r in c] for c in curves if [v for v, _ in c] == versions])
        left.plot(versions, values.mean(0), color=f"C{i}", label=f"{config} ({len(values)} seeds)")
        est = [over_seeds(list(col)) for col in (values - values[:, :1]).T]
        mean, half = np.array([e.mean for e in est]), np.array([e.half_width if e.n > 1 else 0.0 for e in est])
        right.plot(versions, mean, color=f"C{i}")
        right.fill_between(versions, mean - half, mean + half, color=f"C{i}", alpha=0.12)
    left.set(xlabel="version (trainer step)", ylabel="held-out reward", title="held-out, mean over seeds")
    right.set(xlabel="version (trainer step)", ylabel="held-out − v0", title="rise over the run's own v0 (95 % interval)")
    fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--experts", type=int, nargs="*", default=[4, 8, 16, 32])
    ap.add_argument("--samples", type=int, default=8, help="completions per held-out prompt in the mismatch check")
    ap.add_argument("--variant", action="append", default=[], help='"label:key=value,key=value": another MoE configuration')
    a = ap.parse_args()
    configs = dict(CONFIGS)
    for v in a.variant:
        label, _, sets = v.partition(":")
        configs[label] = ("MoE", dict(kv.split("=", 1) for kv in sets.split(",") if kv))
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        sweep = mismatch_sweep(Path(tmp), a.experts, a.samples) if a.experts else []
        runs = [learning_run(Path(tmp), name, base, sets, seed) for seed in range(a.seeds) for name, (base, sets) in configs.items()]
    summary: dict[str, dict[str, Any]] = {}
    for name in configs:
        mine = [r for r in runs if r["config"] == name]
        summary[name] = {k: list(vars(over_seeds([r[k] for r in mine])).values()) for k in ("held_out_v0", "held_out_last5", "rise")}
        summary[name] |= {k: statistics.mean(r[k] for r in mine) for k in ("step_s_median", "logprob_gap_mean", "wall_s")}
        summary[name] |= {k: statistics.mean(r[k] for r in mine) for k in ("routing_mismatch_training", "routing_bytes") if k in mine[0]}
    by = {n: [r for r in runs if r["config"] == n] for n in configs}
    differences = {label: {k: list(vars(paired([r[k] for r in by[mine]], [r[k] for r in by[base]])).values())
                           for k in ("held_out_last5", "rise")} for label, (mine, base) in PAIRS.items()}
    t = Table(title=f"dense, MoE and routing replay: {a.seeds} seeds")
    for c in ("config", "held-out v0", "last 5", "rise", "step", "|Δ logprob|", "mismatch", "routing bytes"):
        t.add_column(c)
    for name, s in summary.items():
        t.add_row(name, f"{s['held_out_v0'][0]:.3f}", f"{s['held_out_last5'][0]:.3f} ± {s['held_out_last5'][1]:.3f}",
                  f"{s['rise'][0]:+.3f} ± {s['rise'][1]:.3f}", f"{1e3 * s['step_s_median']:.1f} ms", f"{s['logprob_gap_mean']:.4f}",
                  f"{s.get('routing_mismatch_training', 0):.4f}", f"{s.get('routing_bytes', 0):.0f}")
    Console().print(t)
    figure = ROOT / "benchmarks" / "figures" / "moe-learning.png"
    plot(runs, figure)
    write("moe", {"seeds": a.seeds, "samples": a.samples, "sweep": sweep, "runs": runs, "summary": summary,
                  "differences": differences, "configs": {k: v[1] for k, v in configs.items()},
                  "figure": str(figure.relative_to(ROOT))})


if __name__ == "__main__":
    main()
