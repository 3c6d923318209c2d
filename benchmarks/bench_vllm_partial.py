"""When a weight version reaches a real vLLM's generation in flight (its CPU build): partial rollouts on against off.

Run with the vLLM environment's Python (``bash examples/vllm_cpu_env.sh``):
``.venv-vllm/bin/python benchmarks/bench_vllm_partial.py [--sizes recipe 135M] [--versions 6] [--mode inprocess]``.
Writes ``benchmarks/results/vllm_partial.json``.

Per size and setting (``rollout.partial_rollouts`` off, then on), one vllm engine and one weight plane (an embedded
nats-server, a trainer's ``WeightPublisher``, the node's ``WeightSync``, whose sync is the node's). A keyframe first;
then generations of ``--rows`` rows of up to ``--tokens`` new tokens run back to back, as a node's slots keep its
engine busy, while ``--versions`` dense versions are published at random moments (every tensor changed, as a training
step changes them). Per version:

* ``landed_s``: from the announcement to the version served (the worker's fetch and checks, then the install: off,
  after the generation in flight; on, between two of its decoding steps);
* ``stall_s``: how long generation was held for the install (on: the pause, the install, the running requests'
  preemption, the resume).

And per setting: the completions generated, those that carry two versions, the tokens a second inside the generation
calls (on: the pauses and the recompute the preemption costs included), and a call's time for scale. Medians over the
versions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import threading
import time
from typing import Any

import result_files
import torch
from bench_vllm_stall import SIZES

from astraflow.config import ModelConfig, RolloutConfig
from astraflow.models import build_model, load_tokenizer
from astraflow.rollout.engines.base import Completion, GenerationRequest, SamplingParams
from astraflow.rollout.engines.registry import build_engine
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.server import EmbeddedServer
from astraflow.streams.state import StateReadError
from astraflow.streams.topology import Topology
from astraflow.weights.publish import WeightPublisher
from astraflow.weights.sync import WeightSync


class Generations:
    """Generation calls back to back on a thread until ``stop`` (a node's slots keeping its engine busy)."""

    def __init__(self, engine: Any, rows: int, tokens: int) -> None:
        params = SamplingParams(max_new_tokens=tokens, temperature=1.0)
        self.requests = [GenerationRequest([10 + (i + j) % 200 for j in range(12 + i % 5)], params) for i in range(rows)]
        self.engine = engine
        self.completions: list[Completion] = []
        self.call_s: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            self.completions += self.engine.generate(self.requests)
            self.call_s.append(time.perf_counter() - t0)


async def published(pub: WeightPublisher, state: dict[str, torch.Tensor], version: int) -> None:
    """Publish ``version``, trying again when the plane did not answer in time: in-process, the trainer's publisher
    shares this process's GIL with the engine's busy driver, which a real trainer does not."""
    for attempt in range(3):
        try:
            await pub.publish(state, version)
            return
        except (StateReadError, TimeoutError):
            if attempt == 2:
                raise


async def measure(name: str, mode: str, partial: bool, versions: int, rows: int, tokens: int) -> dict[str, Any]:
    tok = load_tokenizer("byt5")
    mcfg = ModelConfig(**SIZES[name], max_positions=tokens + 32)
    engine = build_engine(mcfg, RolloutConfig(engine={"type": "vllm", "mode": mode}, partial_rollouts=partial), tok)
    torch.manual_seed(0)
    model = build_model(mcfg, tok)
    rng = random.Random(0)
    row: dict[str, Any] = {"size": name, "parameters": sum(p.numel() for p in model.parameters()), "partial_rollouts": partial}
    landed: list[dict[str, float]] = []
    try:
        with tempfile.TemporaryDirectory() as d, EmbeddedServer(d) as server:
            plane = await Plane.connect(NatsOptions(url=server.url), "vllmpartial", "bench")
            try:
                await plane.ensure_topology(Topology(policies=("solver",)))
                pub = WeightPublisher(plane, "solver", keyframe_every=1000, max_delta_fraction=1.0)
                sync = WeightSync(plane, "solver", engine)
                await pub.publish(model.state_dict(), 0)
                await sync.wait_for(0, timeout=600)
                gens = Generations(engine, rows, tokens)
                gens.thread.start()
                for version in range(1, versions + 1):
                    await asyncio.sleep(rng.uniform(0.2, 1.0))  # a version is announced at any moment of a call
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.randn_like(p) * 1e-3)
                    await published(pub, model.state_dict(), version)
                    t0 = time.perf_counter()
                    await sync.wait_for(version, timeout=600)
                    landed.append({"landed_s": time.perf_counter() - t0, "stall_s": engine.stall_s})
                gens.stop.set()
                await asyncio.to_thread(gens.thread.join, 600)
            finally:
                await plane.close()
    finally:
        engine.close()
    med = statistics.median
    row.update({k: round(med(r[k] for r in landed), 4) for k in landed[0]})
    row["landed_max_s"] = round(max(r["landed_s"] for r in landed), 4)
    row["completions"] = len(gens.completions)
    row["switched"] = sum(len(set(c.versions)) > 1 for c in gens.completions)
    row["tokens_per_s"] = round(sum(len(c.token_ids) for c in gens.completions) / sum(gens.call_s), 1)  # inside the calls
    row["call_s"] = round(med(gens.call_s), 4)
    return row


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["recipe", "135M"], choices=list(SIZES))
    ap.add_argument("--mode", choices=["inprocess", "server"], default="inprocess")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/vllm_partial.json")
    args = ap.parse_args()
    rows = []
    for name in args.sizes:
        for partial in (False, True):
            rows.append(asyncio.run(measure(name, args.mode, partial, args.versions, args.rows, args.tokens)))
            print(json.dumps(rows[-1]), flush=True)
    out = {"mode": args.mode, "versions": args.versions, "rows": args.rows, "tokens": args.tokens, "runs": rows}
    result_files.write("vllm_partial", out, args.out)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
