"""The per-version path, side by side for two source trees: the trainer's time outside its optimizer step, and a
node's time to apply a delta of a 2 MB model.

Each tree runs in its own child processes (``PYTHONPATH`` = the tree), on a fresh embedded nats-server:

1. **node**: a Qwen2 of 1.08 M parameters (hidden 128, 4 layers; 2.2 MB in bf16) takes real AdamW steps on random
   tokens; a ``WeightPublisher`` announces each as a delta; a ``WeightSync`` with an ``hf`` engine follows. Per
   version, medians: fetch + apply (``_apply_chain``, the whole), and its parts: apply (``DeltaApplier``: decode and
   add in place), the state digest, the install into the engine, and the rest (the fetch and the thread hops).
2. **trainer**: the arithmetic recipe's shape (the same model, 8 prompts x 8 samples per batch) trained by the real
   trainer worker (``astraflow worker trainer``) from planned batches published beforehand, with a checkpoint
   directory. Per version: the time between two announcements (``interval``) and that less the step, the batch fetch
   and the wait for the batch (``outside``): bf16 copy, checkpoint, vetting, acks, and whatever of the publish (encode,
   write, announce) the step does not hide.

    python benchmarks/bench_per_version.py --before /path/to/old/tree [--versions 16] [--checkpoint-every 1 10] [--halves trainer]
        [--trainer-cores 1]

The trees take turns in ABBA order over the ``--checkpoint-every`` list (``10 10`` runs before, after, after, before).

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"hidden_size": 128, "intermediate_size": 512, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}


def _ms(xs: list[float]) -> float:
    return round(1000 * statistics.median(xs), 2)


async def node_child(versions: int) -> dict[str, object]:
    import torch

    from astraflow.config import parse_recipe
    from astraflow.models import build_model, load_tokenizer
    from astraflow.rollout.engines.hf import HFEngine
    from astraflow.streams.plane import NatsOptions, Plane
    from astraflow.streams.server import EmbeddedServer
    try:  # the module that applies and installs: the held image's, where the tree has one
        from astraflow.weights import image as sync_module
    except ImportError:
        from astraflow.weights import sync as sync_module  # type: ignore[no-redef]
    from astraflow.weights.publish import WeightPublisher
    from astraflow.weights.sync import WeightSync

    torch.set_num_threads(1)
    recipe = parse_recipe({"name": "bench", "model": MODEL})
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer(pcfg.model.tokenizer)
    torch.manual_seed(0)
    model = build_model(pcfg.model, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(0)
    totals = dict.fromkeys(("apply", "digest", "install"), 0.0)  # seconds so far, per part
    per_chain: dict[str, list[float]] = {k: [] for k in ("whole", *totals)}
    sizes: list[int] = []

    def timed(part: str, fn):
        def run(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                totals[part] += time.perf_counter() - t
        return run

    class TimedApplier(sync_module.DeltaApplier):  # decode + add in place, as the payload is fed, and the final checks
        feed = timed("apply", sync_module.DeltaApplier.feed)
        close = timed("apply", sync_module.DeltaApplier.close)

    sync_module.DeltaApplier = TimedApplier
    sync_module.state_digest = timed("digest", sync_module.state_digest)
    sync_module.install = timed("install", sync_module.install)
    with tempfile.TemporaryDirectory() as d:
        server = EmbeddedServer(Path(d)).start()
        plane = await Plane.connect(NatsOptions(url=server.url), "b" + uuid.uuid4().hex[:8], "bench")
        try:
            await plane.ensure_topology(recipe.topology())
            pub = WeightPublisher(plane, "solver", keyframe_every=10_000)
            sync = WeightSync(plane, "solver", HFEngine(build_model(pcfg.model, tok), tok))
            holder = getattr(sync, "held", sync)  # the tree's held image applies chains (before it, the sync did)
            chain_name = "apply_chain" if holder is not sync else "_apply_chain"
            apply_chain = getattr(holder, chain_name)

            async def timed_chain(c):
                t, before = time.perf_counter(), dict(totals)
                await apply_chain(c)
                per_chain["whole"].append(time.perf_counter() - t)
                for k, total in totals.items():
                    per_chain[k].append(total - before[k])

            setattr(holder, chain_name, timed_chain)
            await pub.publish(model.state_dict(), 0)
            await sync.wait_for(0)
            for xs in per_chain.values():
                xs.clear()
            for v in range(1, versions + 1):
                x = torch.randint(0, 200, (8, 32), generator=gen)
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
                ann = await pub.publish(model.state_dict(), v)
                assert ann.encoding == "delta"
                sizes.append(ann.objects[0].size)
                await sync.wait_for(v)
        finally:
            await plane.close()
            server.stop()
    n_params = sum(p.numel() for p in model.state_dict().values())
    rest = [whole - sum(per_chain[k][i] for k in totals) for i, whole in enumerate(per_chain["whole"])]
    return {"params": n_params, "bf16_mb": round(2 * n_params / 2**20, 2), "delta_kb": round(statistics.median(sizes) / 1024, 1),
            "fetch_and_apply_ms": _ms(per_chain["whole"]), **{f"{k}_ms": _ms(per_chain[k]) for k in totals},
            "fetch_and_hops_ms": _ms(rest)}


async def trainer_child(versions: int, checkpoint_every: int, work: Path, cores: list[int] | None) -> dict[str, object]:
    import yaml

    from astraflow.config import load_recipe
    from astraflow.models import build_model, load_tokenizer
    from astraflow.streams.messages import WeightVersion
    from astraflow.streams.plane import NatsOptions, Plane
    from astraflow.streams.server import EmbeddedServer
    from astraflow.streams.state import BatchPlanRecord
    from astraflow.streams.trajectories import TrainingBatch, publish_trajectories
    from astraflow.tasks import load_split
    from astraflow.train.synthetic import sample_batches

    recipe_file = work / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump({
        "name": "bench", "model": MODEL, "sft": {"steps": 0}, "eval": {"enabled": False},
        "trainer": {"steps": versions, "checkpoint_every": checkpoint_every, "threads": 1, "cores": cores or "shared"},
        "dataflow": {"max_staleness": 64, "group_size": 8, "groups_per_batch": 8}}))
    recipe = load_recipe(recipe_file)
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer(pcfg.model.tokenizer)
    train, _ = load_split(recipe.data)
    batches = sample_batches(build_model(pcfg.model, tok), tok, [p.prompt for p in train[:64]], n_batches=versions,
                             groups_per_batch=8, group_size=8, max_new_tokens=8, logprob_noise=0.2, seed=0)
    server = EmbeddedServer(work / "nats").start()
    run = "b" + uuid.uuid4().hex[:8]
    plane = await Plane.connect(NatsOptions(url=server.url), run, "bench")
    try:
        await plane.ensure_topology(recipe.topology())
        placed = []
        for b in batches:
            seqs = await publish_trajectories(plane, b.trajectories)
            refs = [r.model_copy(update={"seq": s}) for r, s in zip(b.manifest.refs, seqs, strict=True)]
            placed.append(TrainingBatch(b.manifest.model_copy(update={"refs": refs}), b.trajectories))
        await plane.state.put_many([BatchPlanRecord(policy="solver", batch_id=b.batch_id, digest=b.manifest.digest(),
                                                    trajectories=len(b.manifest.refs)) for b in placed])
        await plane.publish_many([(plane.names.batch("solver"), b.manifest, b.batch_id) for b in placed])
        cmd = [sys.executable, "-m", "astraflow.cli", "worker", "trainer", "--recipe", str(recipe_file), "--nats", server.url,
               "--run", run, "--id", "trainer-solver", "--policy", "solver", "--checkpoint-dir", str(work / "ckpt")]
        with open(work / "trainer.log", "wb") as log:
            rc = await asyncio.to_thread(subprocess.call, cmd, stdout=log, stderr=subprocess.STDOUT)
        if rc != 0:
            raise RuntimeError(f"trainer exited {rc}: {(work / 'trainer.log').read_text()[-2000:]}")
        anns = [a for a in await plane.history(plane.names.weights("solver"), WeightVersion)]
    finally:
        await plane.close()
        server.stop()
    out, step, interval = [], [], []
    for prev, a in itertools.pairwise(anns):  # from v2: v1's interval holds the trainer's start-up
        m = a.metrics
        interval.append(a.created_at - prev.created_at)
        out.append(interval[-1] - m["step_s"] - m["fetch_s"] - m["batch_wait_s"])
        step.append(m["step_s"])
    return {"checkpoint_every": checkpoint_every, "versions": len(anns) - 1, "interval_ms": _ms(interval), "step_ms": _ms(step),
            "outside_step_ms": _ms(out), "outside_frac": round(statistics.median(out) / statistics.median(step), 3)}


def run_child(tree: Path, args: list[str]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=False, help="the baseline source tree")
    ap.add_argument("--after", type=Path, default=ROOT)
    ap.add_argument("--versions", type=int, default=16)
    ap.add_argument("--checkpoint-every", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--halves", choices=["node", "trainer"], nargs="+", default=["node", "trainer"], help="which halves to run")
    ap.add_argument("--trainer-cores", type=int, nargs="+", default=None, help="CPUs the trainer trains on "
                    "(trainer.cores), as up gives it cores of its own; default: not pinned")
    ap.add_argument("--child", choices=["node", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "node":
        return asyncio.run(node_child(args.versions))
    if args.child == "trainer":
        return asyncio.run(trainer_child(args.versions, args.checkpoint_every[0], args.work, args.trainer_cores))
    trees = {"before": args.before, "after": args.after} if args.before else {"after": args.after}
    out: dict[str, object] = {"model": MODEL, "versions": args.versions, "node": {}, "trainer": {}}
    for name, tree in trees.items() if "node" in args.halves else ():
        out["node"][name] = run_child(tree, ["--child", "node", "--versions", str(args.versions)])  # type: ignore[index]
        print(name, "node", out["node"][name], flush=True)  # type: ignore[index]
    for i, every in enumerate(args.checkpoint_every if "trainer" in args.halves else ()):
        order = list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]  # ABBA: a load that drifts favours neither
        for name, tree in order:
            with tempfile.TemporaryDirectory() as d:
                cores = ["--trainer-cores", *map(str, args.trainer_cores)] if args.trainer_cores else []
                r = run_child(tree, ["--child", "trainer", "--versions", str(args.versions), "--checkpoint-every", str(every),
                                     "--work", d, *cores])
            out["trainer"][f"{name}, checkpoint_every {every}, #{i + 1}"] = r  # type: ignore[index]
            print(name, "trainer", r, flush=True)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
