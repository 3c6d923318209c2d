"""Data parallel on CPU: the deepspeed backend on 1 rank vs 2 ranks (torchrun, gloo), side by side.

The same batches (real tokens sampled from the model, saved once; ``bench_trainer.make_batches``),
the same model and seed, the same ``micro_batch_tokens``: each configuration is one torchrun launch
whose rank 0 names every step to the others through ``train/distributed.Collective``, as the trainer
does, so the batch's broadcast is part of the step. Per configuration: the step time (median over
steps after a warm-up step), training tokens/s, the loss of every step, and the peak RSS of each
rank. The same total of torch threads in every configuration (``--threads``, split over the ranks),
in interleaved rounds, each configuration keeping its fastest round.

Run: ``python benchmarks/bench_ranks.py [--steps 4] [--rounds 2] [--threads 2]``. Last stdout line: JSON.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainer import MODEL, load_batches, make_batches

CONFIGS = {"torch-1proc": 1, "deepspeed-1rank": 1, "deepspeed-2ranks": 2}  # name -> processes


def child(batch_file: Path, out_dir: Path, backend_name: str, steps: int, threads: int, micro_batch_tokens: int, stage: int) -> None:
    import torch

    from astraflow.config import parse_recipe
    from astraflow.models import build_model, load_tokenizer
    from astraflow.train.backend import build_backend
    from astraflow.train.distributed import Collective

    torch.set_num_threads(threads)
    batches = load_batches(batch_file)
    recipe = parse_recipe({"name": "bench", "model": MODEL, "trainer": {"backend": backend_name, "zero_stage": stage,
                                                                         "micro_batch_tokens": micro_batch_tokens}})
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer(pcfg.model.tokenizer)
    torch.manual_seed(pcfg.trainer.seed)
    backend = build_backend(backend_name, build_model(pcfg.model, tok), tok, pcfg.trainer)
    run_op = Collective(backend)
    if backend.rank != 0:
        run_op.follow()
    else:
        metrics = [run_op.step(b) for b in batches[: steps + 1]]  # the first: warm-up
        run_op.stop()
        timed = metrics[1:]
        (out_dir / "result.json").write_text(json.dumps({
            "step_s": round(statistics.median(m["step_s"] for m in timed), 3),
            "tokens_per_s": round(statistics.median(m["tokens"] / m["step_s"] for m in timed), 1),
            "losses": [round(m["loss"], 6) for m in metrics], "grad_norms": [round(m["grad_norm"], 6) for m in metrics],
            "micro_batches": metrics[0]["micro_batches"], "world_size": backend.world_size}))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    (out_dir / f"rss-{backend.rank}.json").write_text(json.dumps(round(rss, 1)))


def launch(name: str, batch_file: Path, args: argparse.Namespace) -> dict[str, object]:
    procs = CONFIGS[name]
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        child_args = [__file__, "--child", name, "--batches", str(batch_file), "--out", str(out), "--steps", str(args.steps),
                      "--threads", str(max(1, args.threads // procs)), "--micro-batch-tokens", str(args.micro_batch_tokens),
                      "--stage", str(args.stage)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs), *child_args]
        if name.startswith("torch-"):
            cmd = [sys.executable, *child_args]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // procs))}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not (out / "result.json").exists():
            return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
        result: dict[str, object] = json.loads((out / "result.json").read_text())
        rss = [json.loads(p.read_text()) for p in sorted(out.glob("rss-*.json"))]
        result.update(peak_rss_mb_per_rank=rss, peak_rss_mb_total=round(sum(rss), 1))
        return result


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in all, split over the ranks")
    ap.add_argument("--micro-batch-tokens", type=int, default=512, help="small enough for several micro-batches per rank")
    ap.add_argument("--stage", type=int, default=2, help="ZeRO stage of the deepspeed configurations")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--batches", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(Path(args.batches), Path(args.out), args.child.split("-")[0], args.steps, args.threads, args.micro_batch_tokens, args.stage)
        sys.exit(0)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/astraflow-torch-ext"))
    out: dict[str, object] = {"model": MODEL, "threads": args.threads, "micro_batch_tokens": args.micro_batch_tokens,
                              "zero_stage": args.stage}
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as d:
        batch_file = Path(d) / "batches.json"
        out["batch"] = make_batches(batch_file, args.steps + 1)
        for _round in range(args.rounds):  # interleaved rounds; each config keeps its fastest (a shared machine's bursts)
            for name in CONFIGS:
                r = launch(name, batch_file, args)
                prev = results.get(name)
                if prev is None or "error" in prev or ("error" not in r and float(r["step_s"]) < float(prev["step_s"])):  # type: ignore[arg-type]
                    results[name] = r
    out["configs"] = results
    out["load_average_1m_at_end"] = round(os.getloadavg()[0], 1)  # the machine is shared: timings are only as quiet as it was
    print(f"{'config':<18} {'step s':>7} {'tokens/s':>9} {'peak RSS MB (per rank)':>24}  losses")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<18} error: {r['error']}")
        else:
            print(f"{name:<18} {r['step_s']:>7} {r['tokens_per_s']:>9} {r['peak_rss_mb_per_rank']!s:>24}  {r['losses']}")
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
