"""Trainer throughput and memory, torch vs deepspeed side by side; trainer wait fraction in the CPU recipe.

1. The same batches (real tokens sampled from the model, saved once) are trained by each
   backend configuration in its own child process, on the same model and seed: training
   tokens/s (counted tokens over step time, median over steps after a warm-up step) and peak memory (peak RSS of
   the process and its growth over the model-built baseline; on CUDA, peak allocated). The
   configurations run in interleaved rounds and each keeps its fastest round.
2. ``astraflow up recipes/arithmetic`` (every role a process): the fraction of wall time the
   trainer spent waiting for a batch, as it reports in its last announcement.

Run: ``python benchmarks/bench_trainer.py [--steps 5] [--rounds 2] [--bf16] [--skip-recipe]``. Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "max_positions": 128}
CONFIGS = [
    ("torch", {"backend": "torch"}),
    ("deepspeed-zero1", {"backend": "deepspeed", "zero_stage": 1}),
    ("deepspeed-zero2", {"backend": "deepspeed", "zero_stage": 2}),
    ("deepspeed-zero3", {"backend": "deepspeed", "zero_stage": 3}),
]
BF16 = [  # default on CUDA only: CPUs without native bf16 matmuls emulate it, 10x slower than fp32
    ("torch-bf16", {"backend": "torch", "precision": "bf16"}),
    ("deepspeed-zero2-bf16", {"backend": "deepspeed", "zero_stage": 2, "precision": "bf16"}),
]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(batch_file: Path, over: dict[str, object], steps: int, threads: int, micro_batch_tokens: int) -> dict[str, object]:
    import torch

    from astraflow.config import parse_recipe
    from astraflow.models import build_model, load_tokenizer
    from astraflow.train.backend import build_backend

    torch.set_num_threads(threads)
    __import__(f"astraflow.train.{over['backend']}_backend")  # import the backend's packages before the baseline
    batches = load_batches(batch_file)
    recipe = parse_recipe({"name": "bench", "model": MODEL, "trainer": {"micro_batch_tokens": micro_batch_tokens, **over}})
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer(pcfg.model.tokenizer)
    model = build_model(pcfg.model, tok)
    cuda = torch.cuda.is_available()
    base = _peak_rss_mb()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    backend = build_backend(pcfg.trainer.backend, model, tok, pcfg.trainer)
    backend.step(batches[0])  # warm-up
    rates, secs, losses = [], [], []
    for i in range(steps):
        m = backend.step(batches[1 + i % (len(batches) - 1)])
        rates.append(m["tokens"] / m["step_s"])
        secs.append(m["step_s"])
        losses.append(round(m["loss"], 6))
    # median over steps: the machine may be shared, and a median shrugs off a few slow steps
    return {
        "tokens_per_s": round(statistics.median(rates), 1),
        "step_s": round(statistics.median(secs), 3),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "train_rss_mb": round(_peak_rss_mb() - base, 1),
        "cuda_peak_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
        "losses": losses,
        "micro_batches": m["micro_batches"],
        "device": "cuda" if cuda else "cpu",
    }


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def load_batches(path: Path) -> list[Any]:
    """The training batches ``make_batches`` saved: each manifest with its trajectories."""
    from astraflow.streams.codec import decode
    from astraflow.streams.messages import Batch, Trajectory
    from astraflow.streams.trajectories import TrainingBatch

    return [TrainingBatch(decode(bytes.fromhex(b["manifest"]), Batch), [decode(bytes.fromhex(t), Trajectory) for t in b["trajectories"]])
            for b in json.loads(path.read_text())["batches"]]


def make_batches(path: Path, n: int) -> dict[str, object]:
    import torch

    from astraflow.config import parse_recipe
    from astraflow.models import build_model, load_tokenizer
    from astraflow.streams.codec import encode
    from astraflow.tasks import load_split
    from astraflow.train.synthetic import sample_batches

    torch.set_num_threads(2)
    recipe = parse_recipe({"name": "bench", "model": MODEL})
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer(pcfg.model.tokenizer)
    train, _ = load_split(recipe.data)
    batches = sample_batches(build_model(pcfg.model, tok), tok, [p.prompt for p in train[:64]], n_batches=n,
                             groups_per_batch=8, group_size=8, max_new_tokens=24, logprob_noise=0.2, seed=0)
    encoded = [{"manifest": encode(b.manifest).hex(), "trajectories": [encode(t).hex() for t in b.trajectories]} for b in batches]
    path.write_text(json.dumps({"batches": encoded}))
    n_params = sum(p.numel() for p in build_model(pcfg.model, tok).parameters())
    return {
        "trajectories_per_batch": len(batches[0].trajectories),
        "tokens_per_batch": sum(len(t.completion_ids) // 4 for t in batches[0].trajectories),
        "params": n_params,
    }


def recipe_wait(steps: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "bench-trainer"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "astraflow.cli", "up", str(ROOT / "recipes" / "arithmetic"), "--run-dir", str(run_dir),
                        "--set", f"trainer.steps={steps}"], check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    return {"steps": steps, "wall_s": round(wall, 1), "trainer_wait_frac": round(last["wait_frac"], 3),
            "trainer_tokens_per_s": round(sum(r.get("tokens_per_s", 0) for r in rows[1:]) / max(1, len(rows) - 1), 1)}


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--recipe-steps", type=int, default=20)
    ap.add_argument("--skip-recipe", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="also bf16 on CPU (slow without native bf16 matmuls)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--batches", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        over = dict(CONFIGS + BF16)[args.child]
        print(json.dumps(child(Path(args.batches), over, args.steps, args.threads, args.micro_batch_tokens)))
        sys.exit(0)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/astraflow-torch-ext"))
    out: dict[str, object] = {"model": MODEL, "threads": args.threads, "micro_batch_tokens": args.micro_batch_tokens}
    with tempfile.TemporaryDirectory() as d:
        batch_file = Path(d) / "batches.json"
        out["batch"] = make_batches(batch_file, args.steps + 1)
        results: dict[str, dict[str, object]] = {}
        configs = CONFIGS + (BF16 if args.bf16 or _has_cuda() else [])
        for _round in range(args.rounds):  # interleaved rounds; each config keeps its fastest (a shared machine's bursts)
            for name, _ in configs:
                proc = subprocess.run([sys.executable, __file__, "--child", name, "--batches", str(batch_file), "--steps", str(args.steps),
                                       "--threads", str(args.threads), "--micro-batch-tokens", str(args.micro_batch_tokens)],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    results[name] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
                    continue
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                prev = results.get(name)
                r["rounds_tokens_per_s"] = [*(prev or {}).get("rounds_tokens_per_s", []), r["tokens_per_s"]]  # type: ignore[misc]
                if prev is None or "error" in prev or float(r["tokens_per_s"]) > float(prev["tokens_per_s"]):  # type: ignore[arg-type]
                    results[name] = r
                else:
                    prev["rounds_tokens_per_s"] = r["rounds_tokens_per_s"]
    out["backends"] = results
    print(f"{'config':<22} {'tokens/s':>9} {'step s':>7} {'peak RSS MB':>12} {'train RSS MB':>13}  losses")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<22} error: {r['error']}")
        else:
            print(f"{name:<22} {r['tokens_per_s']:>9} {r['step_s']:>7} {r['peak_rss_mb']:>12} {r['train_rss_mb']:>13}  {r['losses']}")
    if not args.skip_recipe:
        out["recipe"] = recipe_wait(args.recipe_steps)
        print(f"CPU recipe: trainer waits for data {100 * out['recipe']['trainer_wait_frac']:.1f}% of wall time")
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
