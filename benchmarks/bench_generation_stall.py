"""What a weight version costs the generation in flight, on the ``hf`` engine, at sizes up to 1.7B, with
``rollout.partial_rollouts`` off and on.

Per size, an ``HFEngine`` generates a batch (``--rows`` rows, ``--tokens`` new tokens) undisturbed, then with a new
version's load arriving after its first decoding step; with ``rollout.partial_rollouts`` off, then on. A load is the
full bf16 state written in place into the model's parameters (``load_state``, what ``install`` does for a dense delta,
where every tensor changed). Every forward pass is timed. Reported, medians over ``--repeats``:

* ``step_s``: a decoding step of the undisturbed batch;
* ``stall_s``: the longest time between two decoding steps of the disturbed batch, less ``step_s``: how long the batch
  stood still for the version (on: the apply, and the new weights recomputing the prefix; off: nothing, the load waits
  for the batch to end and the *next* batch waits ``apply_s``);
* ``apply_s``: the time the engine is held for the load (the in-place copy);
* ``landed_after_s``: from the load's request until the version is in the engine (off: after the batch in flight).

Models are Qwen2 stacks built from their config with the byte tokenizer (384 embeddings), so a size's parameter count
is its transformer layers' (stated per row). Run: ``python benchmarks/bench_generation_stall.py [--sizes recipe 0.5B]``.
Writes ``benchmarks/results/generation_stall.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import result_files
import torch

from astraflow.config import ModelConfig
from astraflow.models import build_model, load_tokenizer
from astraflow.rollout.engines.base import GenerationRequest, SamplingParams
from astraflow.rollout.engines.hf import HFEngine

ROOT = Path(__file__).resolve().parent.parent
SIZES = {  # the layer shapes of public models of these sizes
    "recipe": dict(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2),
    "135M": dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3),
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8),
}


def timed_generation(engine: HFEngine, prompts: list[list[int]], params: SamplingParams,
                     load: dict[str, torch.Tensor] | None) -> dict[str, float]:
    """Generate once, timing every forward pass; with ``load``, request it (on another thread) once the first decoding
    step has run. ``longest_gap_s``: the longest time between the ends of two forward passes after the prefill."""
    forward, ends, out = engine.model.forward, [], {}
    loader: threading.Thread | None = None

    def apply() -> None:
        t0 = time.perf_counter()
        engine.load_state(load, engine.version + 1)  # type: ignore[arg-type]
        out["landed_after_s"] = time.perf_counter() - t0

    def timed(*args: Any, **kwargs: Any) -> Any:
        nonlocal loader
        if len(ends) == 2 and load is not None and loader is None:
            loader = threading.Thread(target=apply)
            loader.start()
            while engine._loads_waiting == 0:
                time.sleep(0.0005)
        result = forward(*args, **kwargs)
        ends.append(time.perf_counter())
        return result

    engine.model.forward = timed
    t0 = time.perf_counter()
    engine.generate([GenerationRequest(p, params) for p in prompts])
    out["gen_s"] = time.perf_counter() - t0
    if loader is not None:
        loader.join()
    engine.model.forward = forward
    gaps = [b - a for a, b in itertools.pairwise(ends[1:])]  # decoding steps (and, on, the switch)
    out["step_s"], out["longest_gap_s"] = statistics.median(gaps), max(gaps)
    return out


def held_time(engine: HFEngine, state: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    engine.load_state(state, engine.version + 1)
    return time.perf_counter() - t0


def measure(name: str, rows: int, tokens: int, repeats: int) -> dict[str, Any]:
    tok = load_tokenizer("byt5")
    torch.manual_seed(0)
    model = build_model(ModelConfig(**SIZES[name], max_positions=tokens + 64), tok)
    params_n = sum(p.numel() for p in model.parameters())
    new = {k: (v + 1e-3 * torch.randn_like(v)).to(torch.bfloat16) for k, v in model.state_dict().items()}
    prompts = [[10 + (i + j) % 200 for j in range(12 + i % 5)] for i in range(rows)]
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=1)
    row: dict[str, Any] = {"size": name, "parameters": params_n, "bf16_bytes": 2 * params_n, "rows": rows, "tokens": tokens}
    for partial in (False, True):
        engine = HFEngine(model, tok, partial_rollouts=partial)
        engine.load_state(model.state_dict(), 0)
        base, disturbed, applies = [], [], []
        for _ in range(repeats):
            base.append(timed_generation(engine, prompts, params, None))
            disturbed.append(timed_generation(engine, prompts, params, new))
            applies.append(held_time(engine, new))
        med = statistics.median
        key = "on" if partial else "off"
        step = med(b["step_s"] for b in base)
        row[key] = {"generation_s": round(med(b["gen_s"] for b in base), 4), "step_s": round(step, 4),
                    "stall_s": round(med(d["longest_gap_s"] for d in disturbed) - step, 4),
                    "apply_s": round(med(applies), 4), "landed_after_s": round(med(d["landed_after_s"] for d in disturbed), 4)}
    return row


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/generation_stall.json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for name in args.sizes:
        rows.append(measure(name, args.rows, args.tokens, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    out = {"rows": args.rows, "tokens": args.tokens, "repeats": args.repeats, "sizes": rows}
    result_files.write("generation_stall", out, args.out)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
