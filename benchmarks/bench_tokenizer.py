"""What a byte-level tokenizer's text costs the roles: ByT5's ids read as bytes (``models.ByteIds``) against ByT5's own
Python encoder and decoder, in one process, the two taking turns.

- ``encode_prompt`` over the arithmetic recipe's training prompts (a node encodes each task's prompt, the dataflow each
  prompt it checks a claim against, the evaluator each held-out prompt);
- ``decode_text`` over completions as a node samples them: 1 to 6 ids of the whole vocabulary, special ids included,
  as in the arithmetic recipes, and 256 ids, as in an agentic one (a node decodes every sample to score it, the
  dataflow every distinct completion it scores again, the evaluator each greedy answer).

Both paths give the same ids and text (``tests/test_claims.py``); the table is microseconds per call, the median of
``--rounds`` rounds, and what one version of the in-process recipe (8 tasks x 8 samples) spends on it in a node: 64
decodes and 16 encodes (the task gate's and the workflow's).

    python benchmarks/bench_tokenizer.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from astraflow import models
from astraflow.config import load_recipe
from astraflow.tasks import load_split

ROOT = Path(__file__).resolve().parent.parent
NODE_DECODES, NODE_ENCODES = 64, 16  # per version of inprocess.yaml: a decode per sample, two encodes per task


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.thread_time()
    fn()
    return 1e6 * (time.thread_time() - start) / calls


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    recipe = load_recipe(ROOT / "recipes" / "arithmetic" / "inprocess.yaml")
    tok = models.load_tokenizer(recipe.policies[recipe.primary].model.tokenizer)
    prompts = [p.prompt for p in load_split(recipe.data)[0][:2000]]
    rng = np.random.default_rng(0)
    completions = [[int(i) for i in rng.integers(0, len(tok), int(rng.integers(1, 7)))] for _ in range(2000)]
    long = [[int(i) for i in rng.integers(0, len(tok), 256)] for _ in range(200)]
    as_bytes = models.byte_ids

    def side(by_bytes: bool) -> dict[str, float]:
        models.byte_ids = as_bytes if by_bytes else (lambda tokenizer: None)  # type: ignore[assignment]
        try:
            return {"encode_us": per_call_us(lambda: [models.encode_prompt(tok, p) for p in prompts], len(prompts)),
                    "decode_us": per_call_us(lambda: [models.decode_text(tok, c) for c in completions], len(completions)),
                    "decode_256_us": per_call_us(lambda: [models.decode_text(tok, c) for c in long], len(long))}
        finally:
            models.byte_ids = as_bytes  # type: ignore[assignment]

    for warm in (True, False):
        side(warm)
    rounds: dict[str, list[dict[str, float]]] = {"tokenizer": [], "bytes": []}
    for _ in range(args.rounds):
        rounds["tokenizer"].append(side(False))
        rounds["bytes"].append(side(True))
    out: dict[str, object] = {"rounds": args.rounds}
    table = Table(title="encode_prompt and decode_text, µs a call (median of rounds)")
    for col in ("path", "encode", "decode, 1-6 ids", "decode, 256 ids", "a node's version (64 decodes, 16 encodes), ms"):
        table.add_column(col)
    for name, rs in rounds.items():
        enc, dec, dec_256 = (statistics.median(r[k] for r in rs) for k in ("encode_us", "decode_us", "decode_256_us"))
        node_ms = (NODE_DECODES * dec + NODE_ENCODES * enc) / 1000
        out[name] = {"encode_us": round(enc, 2), "decode_us": round(dec, 2), "decode_256_us": round(dec_256, 1),
                     "node_version_ms": round(node_ms, 2)}
        table.add_row(name, f"{enc:.1f}", f"{dec:.1f}", f"{dec_256:.0f}", f"{node_ms:.2f}")
    Console(stderr=True).print(table)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
