"""A checkpoint's write beside the trainer's step: the way ``torch.save`` and safetensors' ``save_file`` wrote it, the
way ``train/tensor_files.py`` writes it (the bytes out with the GIL released, a system call per tensor or one
``writev`` for them all), at nice 19 or at the trainer's priority.

The recipe's model (``recipes/arithmetic/inprocess.yaml``: 1.08 M parameters, AdamW) takes real steps on batches of the
recipe's shape (8 prompts x 8 samples) on the last CPU; a second thread writes the trainer's checkpoint (weights and
optimizer state, one copy as ``TorchBackend.snapshot`` takes it) under a temporary directory, on the other CPUs, as
the trainer's checkpoint writer runs under ``up`` (one CPU: beside the step): one write after another, or with
``--every N`` one every N steps, as ``checkpoint_every: N``. With ``--node-load`` a process keeps the writer's CPUs
busy with matmuls at nice 10, as a rollout node does under ``up``. Reported, per writer: the step's median and mean
time beside it against alone, one write's CPU and wall time, and the step time a write costs (the steps' excess over
the same round's alone, per write).

    python benchmarks/bench_checkpoint_write.py [--steps 30] [--rounds 3] [--every N] [--node-load]

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astraflow.config import load_recipe  # noqa: E402
from astraflow.models import build_model, load_tokenizer  # noqa: E402
from astraflow.tasks import load_split  # noqa: E402
from astraflow.train import tensor_files  # noqa: E402
from astraflow.train.synthetic import sample_batches  # noqa: E402
from astraflow.train.tensor_files import IOV_MAX  # noqa: E402
from astraflow.train.threads import LOWEST_PRIORITY, background_executor, spare_cores, usable_core_ids  # noqa: E402
from astraflow.train.torch_backend import TorchBackend, _cpu_copy, _untied_copy  # noqa: E402

Side = tuple[Callable[[TorchBackend], Callable[[Path], None]] | None, int | None, int]  # (the write, nice, IOV_MAX)


def before(backend: TorchBackend) -> Callable[[Path], None]:
    """The write as it was: safetensors' save_file for the weights, torch.save for the optimizer state."""
    weights, aliases = _untied_copy(backend.module.state_dict())
    optimizer = _cpu_copy(backend.opt.state_dict())

    def write(path: Path) -> None:
        save_file(weights, str(path / "model.safetensors"), metadata=aliases or None)
        torch.save(optimizer, path / "optimizer.pt")

    return write


def now(backend: TorchBackend) -> Callable[[Path], None]:
    write = backend.snapshot()
    assert write is not None
    return write


def main(steps: int, rounds: int, node_load: bool, every: int) -> dict[str, object]:
    torch.set_num_threads(1)
    recipe = load_recipe(ROOT / "recipes/arithmetic/inprocess.yaml")
    pcfg = recipe.policies[recipe.primary]
    tok = load_tokenizer(pcfg.model.tokenizer)
    train, _ = load_split(recipe.data)
    backend = TorchBackend(build_model(pcfg.model, tok), tok, pcfg.trainer)
    batches = sample_batches(build_model(pcfg.model, tok), tok, [p.prompt for p in train[:64]], n_batches=4,
                             groups_per_batch=8, group_size=8, max_new_tokens=4, logprob_noise=0.2, seed=0)
    cores = usable_core_ids()
    own, spare = cores[-1:], spare_cores(cores[-1:])
    os.sched_setaffinity(0, own)  # the step's thread, as a pinned trainer's

    def step_times(each: Callable[[int], None] = lambda i: None) -> list[float]:
        out = []
        for i in range(steps):
            each(i)
            t0 = time.perf_counter()
            backend.step(batches[i % len(batches)])
            out.append(time.perf_counter() - t0)
        return out

    def beside(side: Side) -> dict[str, float]:
        make, nice, calls = side
        if make is None:
            times = step_times()
            return {"step_ms": 1000 * statistics.median(times), "step_mean_ms": 1000 * statistics.mean(times)}
        stop, done = threading.Event(), []
        writer = background_executor(spare, "checkpoint-writer", nice)
        tensor_files.IOV_MAX = calls  # buffers a system call takes: 1, a call per tensor
        write = make(backend)  # the copy the trainer's snapshot takes, written again and again

        def timed(work: Path) -> None:
            c0, t0 = time.thread_time(), time.perf_counter()
            write(work)
            done.append((time.thread_time() - c0, time.perf_counter() - t0))

        def loop(work: Path) -> None:
            while not stop.is_set():
                timed(work)

        with tempfile.TemporaryDirectory() as d:
            work = Path(d)
            pending = [writer.submit(loop, work)] if every == 0 else []

            def due(i: int) -> None:  # every `every` steps a write, when the last one is done (as the group commit)
                if every and i % every == 0 and not (pending and not pending[-1].done()):
                    pending.append(writer.submit(timed, work))

            try:
                times = step_times(due)
            finally:
                stop.set()
                for f in pending:
                    f.result()
                writer.shutdown()
                tensor_files.IOV_MAX = IOV_MAX
        return {"step_ms": 1000 * statistics.median(times), "step_mean_ms": 1000 * statistics.mean(times),
                "write_cpu_ms": 1000 * statistics.median(c for c, _ in done),
                "write_wall_ms": 1000 * statistics.median(w for _, w in done), "writes": len(done)}

    backend.step(batches[0])  # the optimizer holds its state
    sides: dict[str, Side] = {
        "alone": (None, None, IOV_MAX),
        "torch.save + save_file, nice 19": (before, LOWEST_PRIORITY, IOV_MAX),
        "tensor_files, a write per tensor, nice 19": (now, LOWEST_PRIORITY, 1),
        "tensor_files, one writev, nice 19": (now, LOWEST_PRIORITY, IOV_MAX),
        "tensor_files, one writev, the trainer's priority": (now, None, IOV_MAX),
    }
    out: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    if node_load and not spare:
        raise SystemExit("--node-load needs a CPU besides the step's")
    node = node_beside(spare) if node_load else None
    try:
        for r in range(rounds):
            for name, side in (sides.items() if r % 2 == 0 else reversed(sides.items())):
                out[name].append(beside(side))
                print(r, name, {k: round(v, 2) for k, v in out[name][-1].items()}, flush=True)
    finally:
        if node is not None:
            node.kill()
            node.wait()
    med = {name: {k: round(statistics.median(x[k] for x in xs), 2) for k in xs[0]} for name, xs in out.items()}
    for name, xs in out.items():  # the step time a write costs: the steps' excess over the same round's alone, per write
        if name != "alone":
            med[name]["step_ms_per_write"] = round(statistics.median(
                (x["step_mean_ms"] - a["step_mean_ms"]) * steps / x["writes"] for x, a in zip(xs, out["alone"])), 2)
    return {"cpus": {"step": own, "writer": spare or own}, "node_load": node_load, "every": every, "steps": steps,
            "rounds": rounds, "median": med}


def node_beside(cores: list[int]) -> subprocess.Popen[bytes]:
    """A process that keeps ``cores`` busy with torch matmuls at nice 10, as a rollout node's generation keeps the
    trainer's spare cores under ``up``."""
    work = "import torch; torch.set_num_threads(1); a = torch.randn(256, 256)\nwhile True: a @ a"
    return subprocess.Popen(["taskset", "-c", ",".join(map(str, cores)), "nice", "-n", "10", sys.executable, "-c", work])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--node-load", action="store_true", help="keep the writer's cores busy at nice 10, as a node does")
    ap.add_argument("--every", type=int, default=0, help="a write every N steps, as `checkpoint_every: N` (0: one write "
                    "after another)")
    args = ap.parse_args()
    print(json.dumps(main(args.steps, args.rounds, args.node_load, args.every)))
