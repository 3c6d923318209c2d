"""Can this machine hide work behind the trainer's step? The bench_per_version model's optimizer step (torch, 1 thread),
alone and beside a thread doing ~40 ms of other work: work that releases the GIL (a torch matmul loop) and work that
holds it (a pure-Python loop). If the GIL-free work slows the step as much as the Python work does, there is no idle
core for a background publish to use, and overlapping it with the step only moves its time into the step.

    python benchmarks/bench_step_beside.py [--steps 8] [--side-ms 40]

Prints the median step per condition, each condition twice, interleaved; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable

import torch

from astraflow.config import parse_recipe
from astraflow.models import build_model, load_tokenizer
from astraflow.tasks import load_split
from astraflow.train.synthetic import sample_batches
from astraflow.train.torch_backend import TorchBackend

MODEL = {"hidden_size": 128, "intermediate_size": 512, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}


def gil_free(seconds: float) -> None:
    a = torch.randn(384, 384)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(a, a)


def gil_bound(seconds: float) -> None:
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1


def main() -> dict[str, list[float]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--side-ms", type=float, default=40.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    recipe = parse_recipe({"name": "bench", "model": MODEL})
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer(pcfg.model.tokenizer)
    train, _ = load_split(recipe.data)
    batches = sample_batches(build_model(pcfg.model, tok), tok, [p.prompt for p in train[:64]], n_batches=2,
                             groups_per_batch=8, group_size=8, max_new_tokens=8, logprob_noise=0.2, seed=0)
    backend = TorchBackend(build_model(pcfg.model, tok), tok, pcfg.trainer)

    def step_ms(side: Callable[[float], None] | None) -> float:
        times = []
        for i in range(args.steps):
            other = threading.Thread(target=side, args=(args.side_ms / 1000,)) if side else None
            t = time.perf_counter()
            if other:
                other.start()
            backend.step(batches[i % 2])
            times.append(time.perf_counter() - t)
            if other:
                other.join()
        return round(1000 * statistics.median(times), 1)

    out: dict[str, list[float]] = {"alone": [], "beside GIL-free work": [], "beside GIL-bound work": []}
    for _ in range(2):
        for name, side in zip(out, (None, gil_free, gil_bound), strict=True):
            out[name].append(step_ms(side))
            print(name, out[name][-1], "ms", flush=True)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
