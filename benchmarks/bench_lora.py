"""LoRA against full fine-tuning, on live ``astraflow up recipes/arithmetic`` runs (the embedded server), the same seeds
and steps: held-out reward (the mean of the last five evaluations, and at equal wall time: the last evaluation each
run had made when the faster of the pair finished), bytes per announced version, the trainer's step time and CPU, the
nodes' CPU.

LoRA (``trainer.lora``, rank ``--rank`` on ``--targets``, every linear layer by default) trains at ``--lora-lr`` (adapters take a larger
step than full fine-tuning's default 3e-4), twice: announcing the adapters alone (``LoRA``, the default) and the merged
full weights (``LoRA, merged``). Then the per-version path, in-process on a fresh embedded server, for the recipe's model
and a wider one: the trainer's image + publish, and a node's fetch + apply + install (``WeightSync.refresh`` into an
``hf`` engine), per version, with every trained element moved by the learning rate (the size of an Adam step).
Writes ``benchmarks/results/lora.json``.

    python benchmarks/bench_lora.py [--seeds 3] [--steps 300] [--rank 16] [--lora-lr 1e-3] [--targets q_proj,...]
        [--modes "full fine-tuning" LoRA] [--path-versions 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
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
from stats import over_seeds, paired  # noqa: E402

from astraflow.config import LoraConfig  # noqa: E402

MODES = ("full fine-tuning", "LoRA", "LoRA, merged")
WIDE = {"hidden_size": 512, "intermediate_size": 2048, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4}


def live_run(base: Path, mode: str, seed: int, steps: int, rank: int, lora_lr: float, targets: list[str]) -> dict[str, Any]:
    run_dir = base / f"{mode.replace(', ', '-').replace(' ', '-')}-{seed}"
    sets: dict[str, Any] = {"trainer.steps": steps, "eval.every": 20, "trainer.seed": seed}
    if mode.startswith("LoRA"):
        sets |= {"trainer.lora.rank": rank, "trainer.lora.alpha": 2 * rank, "trainer.lr": lora_lr,
                 "trainer.lora.target_modules": f"[{','.join(targets)}]",
                 "trainer.lora.announce": "merged" if mode == "LoRA, merged" else "adapter"}
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(ROOT / "recipes" / "arithmetic"), "--run-dir", str(run_dir),
           *(x for k, v in sets.items() for x in ("--set", f"{k}={v}"))]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=3600)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    curve = sorted((int(v), r) for v, r in summary["held_out_reward"].items())
    pol = summary["policies"]["solver"]
    last5 = statistics.mean(r for _, r in curve[-5:])
    out = {"mode": mode, "seed": seed, "held_out_v0": summary["initial_reward"], "held_out_last5": round(last5, 4),
           "rise": round(last5 - summary["initial_reward"], 4),
           "curve": [[v, r, summary["eval_at_s"][str(v)]] for v, r in curve], "wall_s": summary["wall_s"],
           "delta_bytes_mean": round(pol["delta_bytes_mean"]), "keyframe_bytes": pol["keyframe_bytes"],
           "step_s_median": round(statistics.median(r["step_s"] for r in rows if "step_s" in r), 4),
           "trainer_cpu_s_per_64": summary["cpu_s_per_64_samples"]["trainer-solver"],
           "node_cpu_s_per_64": round(statistics.mean(v for k, v in summary["cpu_s_per_64_samples"].items() if k.startswith("rollout")), 4),
           "base_bytes": base_bytes(run_dir)}
    print(json.dumps({k: v for k, v in out.items() if k != "curve"}), flush=True)
    return out


def base_bytes(run_dir: Path) -> int:
    """Bytes of the base model the trainer stored for the nodes (a LoRA run whose warm start trained every weight)."""
    found = [int(m[1]) for log in (run_dir / "logs").glob("trainer*.log")
             for m in re.finditer(r"LoRA adapters over base \w+ \(stored, (\d+) B\)", log.read_text())]
    return max(found, default=0)


async def path_timing(model: dict[str, int], mode: str, versions: int, rank: int, targets: list[str]) -> dict[str, Any]:
    """Per version: the trainer's image + publish, a node's refresh (fetch, apply, install), the bytes announced."""
    import torch

    from astraflow.config import parse_recipe
    from astraflow.models import build_model, load_tokenizer
    from astraflow.rollout.engines.hf import HFEngine
    from astraflow.streams.plane import NatsOptions, Plane
    from astraflow.streams.server import EmbeddedServer
    from astraflow.train.torch_backend import TorchBackend
    from astraflow.weights.delta import state_digest, to_bf16_state
    from astraflow.weights.publish import WeightPublisher
    from astraflow.weights.sync import WeightSync

    recipe = parse_recipe({"name": "path", "model": model})
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer("byt5")
    lora = {"rank": rank, "alpha": 2 * rank, "target_modules": targets, "announce": "merged" if mode == "LoRA, merged" else "adapter"}
    cfg = pcfg.trainer.model_copy(update={"lora": None}) if mode == "full fine-tuning" else \
        type(pcfg.trainer).model_validate({**pcfg.trainer.model_dump(), "lora": lora})
    built = build_model(pcfg.model, tok)
    built_digest = state_digest(to_bf16_state(built.state_dict()))
    backend = TorchBackend(built, tok, cfg)
    trained = [p for p in backend.module.parameters() if p.requires_grad]
    lr = 3e-4 if mode == "full fine-tuning" else 1e-3
    out: dict[str, list[float]] = {"publish_s": [], "apply_s": [], "bytes": []}
    with tempfile.TemporaryDirectory() as d:
        server = EmbeddedServer(Path(d)).start()
        plane = await Plane.connect(NatsOptions(url=server.url), "bench", "bench")
        try:
            await plane.ensure_topology(recipe.topology())
            pub = WeightPublisher(plane, "solver", keyframe_every=10_000)
            base = backend.base_bf16()
            if base is not None:
                await pub.adapt(base, 2.0, built_digest)
            await pub.publish(backend.state_dict_bf16(), 0, force_keyframe=True)
            sync = WeightSync(plane, "solver", HFEngine(build_model(pcfg.model, tok), tok))
            await sync.wait_for(0)
            for v in range(1, versions + 1):
                with torch.no_grad():  # an Adam-size step: every trained element moves by the learning rate
                    for p in trained:
                        p.add_(lr * torch.randn_like(p).sign())
                t0 = time.perf_counter()
                ann = await pub.publish(backend.state_dict_bf16(), v)
                t1 = time.perf_counter()
                await sync.wait_for(v)
                out["publish_s"].append(t1 - t0)
                out["apply_s"].append(time.perf_counter() - t1)
                out["bytes"].append(ann.objects[0].size)
        finally:
            await plane.close()
            server.stop()
    params = sum(p.numel() for p in build_model(pcfg.model, tok).parameters())
    return {"mode": mode, "params": params, "versions": versions, "keyframe_bytes": pub.bytes_sent - sum(out["bytes"]),
            **{k: statistics.median(v[1:]) for k, v in out.items()}}


def at_time(run: dict[str, Any], t: float) -> float:
    """Held-out at the last evaluation made by ``t`` seconds into the run."""
    return max(((s, r) for _, r, s in run["curve"] if s <= t), default=(0.0, run["held_out_v0"]))[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-lr", type=float, default=1e-3)
    ap.add_argument("--targets", default=",".join(LoraConfig().target_modules),
                    help="the linear layers that get an adapter (comma-separated; default: trainer.lora's)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the variants to run live")
    ap.add_argument("--path-versions", type=int, default=12)
    a = ap.parse_args()
    targets, modes = a.targets.split(","), [m for m in MODES if m in a.modes]
    path = [asyncio.run(path_timing(model, mode, a.path_versions, a.rank, targets)) | {"model": name}
            for name, model in (("arithmetic", {}), ("wide", WIDE)) for mode in MODES]
    for row in path:
        print(json.dumps(row), flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        for seed in range(a.seeds):
            pair = [live_run(Path(tmp), mode, seed, a.steps, a.rank, a.lora_lr, targets) for mode in modes]
            t = min(r["curve"][-1][2] for r in pair)  # when the fastest of the seed's runs made its last evaluation
            for r in pair:
                r["held_out_equal_time"] = at_time(r, t)
            runs += pair
    summary: dict[str, dict[str, Any]] = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {key: list(vars(over_seeds([r[key] for r in mine])).values())
                         for key in ("held_out_last5", "held_out_equal_time", "rise")}
        summary[mode] |= {key: statistics.mean(r[key] for r in mine)
                          for key in ("delta_bytes_mean", "keyframe_bytes", "base_bytes", "step_s_median", "node_cpu_s_per_64", "wall_s")}
    by = {m: [r for r in runs if r["mode"] == m] for m in modes}  # LoRA minus full, seed by seed
    diff = {key: list(vars(paired([r[key] for r in by["LoRA"]], [r[key] for r in by[MODES[0]]])).values())
            for key in ("held_out_last5", "held_out_equal_time")}
    t = Table(title=f"LoRA (rank {a.rank}, lr {a.lora_lr:g}) against full fine-tuning, {a.steps} steps, {a.seeds} seeds")
    for c in ("mode", "held-out, last 5", "rise over v0", "at equal wall time", "bytes per version", "step", "wall"):
        t.add_column(c)
    for mode, s_ in summary.items():
        t.add_row(mode, f"{s_['held_out_last5'][0]:.3f} ± {s_['held_out_last5'][1]:.3f}", f"{s_['rise'][0]:+.3f} ± {s_['rise'][1]:.3f}",
                  f"{s_['held_out_equal_time'][0]:.3f} ± {s_['held_out_equal_time'][1]:.3f}", f"{s_['delta_bytes_mean'] / 1024:.1f} KiB",
                  f"{1e3 * s_['step_s_median']:.1f} ms", f"{s_['wall_s']:.0f} s")
    t.add_row("LoRA − full, paired", f"{diff['held_out_last5'][0]:+.3f} ± {diff['held_out_last5'][1]:.3f}",
              "", f"{diff['held_out_equal_time'][0]:+.3f} ± {diff['held_out_equal_time'][1]:.3f}", "", "", "")
    Console().print(t)
    write("lora", {"steps": a.steps, "rank": a.rank, "lora_lr": a.lora_lr, "targets": targets, "seeds": a.seeds, "runs": runs,
                   "summary": summary,
                   "lora_minus_full": diff, "path": path, "wide": WIDE})


if __name__ == "__main__":
    main()
