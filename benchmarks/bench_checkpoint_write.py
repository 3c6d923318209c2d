"""A checkpoint's write beside the trainer's step, the way ``torch.save`` and safetensors' ``save_file`` wrote it and
the way ``train/tensor_files.py`` writes it (the bytes out through ``os.write``, with the GIL released).

The recipe's model (``recipes/arithmetic/inprocess.yaml``: 1.08 M parameters, AdamW) takes real steps on batches of the
recipe's shape (8 prompts x 8 samples) on the last CPU; a second thread writes the trainer's checkpoint (weights and
optimizer state, one copy as ``TorchBackend.snapshot`` takes it) again and again under a temporary directory, on the
other CPUs at nice 19, as the trainer's checkpoint writer runs under ``up`` (one CPU: beside the step). Reported, per
writer: the step's median time beside it against alone, and one write's CPU and wall time.

    python benchmarks/bench_checkpoint_write.py [--steps 30] [--rounds 3]

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
from astraflow.train.synthetic import sample_batches  # noqa: E402
from astraflow.train.threads import background_executor, spare_cores, usable_core_ids  # noqa: E402
from astraflow.train.torch_backend import TorchBackend, _cpu_copy, _untied_copy  # noqa: E402


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


def main(steps: int, rounds: int) -> dict[str, object]:
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

    def step_times() -> list[float]:
        out = []
        for i in range(steps):
            t0 = time.perf_counter()
            backend.step(batches[i % len(batches)])
            out.append(time.perf_counter() - t0)
        return out

    def beside(make: Callable[[TorchBackend], Callable[[Path], None]] | None) -> dict[str, float]:
        if make is None:
            return {"step_ms": 1000 * statistics.median(step_times())}
        stop, done = threading.Event(), []
        writer = background_executor(spare, "checkpoint-writer")

        write = make(backend)  # the copy the trainer's snapshot takes, written again and again

        def loop(work: Path) -> None:
            while not stop.is_set():
                c0, t0 = time.thread_time(), time.perf_counter()
                write(work)
                done.append((time.thread_time() - c0, time.perf_counter() - t0))

        with tempfile.TemporaryDirectory() as d:
            running = writer.submit(loop, Path(d))
            try:
                times = step_times()
            finally:
                stop.set()
                running.result()
                writer.shutdown()
        return {"step_ms": 1000 * statistics.median(times), "write_cpu_ms": 1000 * statistics.median(c for c, _ in done),
                "write_wall_ms": 1000 * statistics.median(w for _, w in done), "writes": len(done)}

    backend.step(batches[0])  # the optimizer holds its state
    sides = {"alone": None, "torch.save + save_file": before, "tensor_files": now}
    out: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for r in range(rounds):
        for name, make in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            out[name].append(beside(make))
            print(r, name, {k: round(v, 2) for k, v in out[name][-1].items()}, flush=True)
    med = {name: {k: round(statistics.median(x[k] for x in xs), 2) for k in xs[0]} for name, xs in out.items()}
    return {"cpus": {"step": own, "writer": spare or own}, "steps": steps, "rounds": rounds, "median": med}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(json.dumps(main(args.steps, args.rounds)))
