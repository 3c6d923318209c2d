"""Encoding a small model's weight delta, two source trees side by side on the same versions.

The trainer of ``recipes/arithmetic/inprocess.yaml`` (a 1.08M-parameter Qwen2: 51 tensors, 2.07 MB in bf16) encodes
the delta of each version on its own core, in line with its loop, so the encoder's time is time outside the step. This
benchmark takes real AdamW versions of that model at the recipe's lr 1e-4 (random tokens), in two regimes:

- ``first steps``: versions 1-6 of a fresh optimizer, where Adam's updates are largest (about half the values change);
- ``steady``: versions 51-56, where about a seventh change, as in a run (``up``'s deltas are 170-240 KB).

Each tree takes every version's bf16 image from the model's float32 weights as its trainer does (``to_bf16_state``) and
encodes every pair in a child process (``PYTHONPATH`` = the tree), the trees taking turns ``--rounds`` times. Two
figures, each the median over rounds of each child's median: the delta's encoding alone, and a version's whole weight
work on the trainer's core (the image taken, checked finite, its digest, the delta encoded). The payloads and digests
of both trees must be byte for byte the same (the wire format does not change).

    python benchmarks/bench_delta_encode.py --before TREE [--rounds 4] [--repeats 30]

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_turns import run_child, take_turns  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REGIMES = {"first steps": (0, 6), "steady": (50, 56)}  # versions kept: [start, end) of the optimizer's steps


def versions(seed: int = 0) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The recipe's model's float32 weights after each AdamW step, per regime."""
    from astraflow.config import load_recipe
    from astraflow.models import build_model, load_tokenizer

    recipe = load_recipe(ROOT / "recipes" / "arithmetic" / "inprocess.yaml")
    m = recipe.policies[recipe.primary].model
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(m.tokenizer)
    model = build_model(m, tokenizer)  # as the trainer builds it
    vocab = len(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    out: dict[str, list[dict[str, torch.Tensor]]] = {name: [] for name in REGIMES}
    for step in range(max(end for _, end in REGIMES.values())):
        ids = torch.randint(0, vocab, (64, 12))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        for name, (start, end) in REGIMES.items():
            if start <= step < end:
                out[name].append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def child(states_file: Path, repeats: int) -> None:
    """In a tree's own process, per regime: the median encode time, the median of a version's whole weight work, and
    the digest of the payloads and state digests (a JSON line)."""
    from astraflow.weights.delta import encode_delta, state_digest, to_bf16_state
    from astraflow.weights.finite import non_finite

    torch.set_num_threads(1)
    result = {}
    for name, weights in torch.load(states_file, weights_only=True).items():
        images = [to_bf16_state(w) for w in weights]  # as this tree's trainer takes them
        pairs = list(pairwise(images))
        digest, times, whole = hashlib.sha256(), [], []
        for base, new in pairs:
            digest.update(encode_delta(base, new)[0] + state_digest(new).encode())
        for r in range(repeats):
            base, new = pairs[r % len(pairs)]
            t = time.perf_counter()
            payload, stats = encode_delta(base, new)
            times.append(time.perf_counter() - t)
        for r in range(repeats):
            i = r % len(pairs)
            t = time.perf_counter()
            image = to_bf16_state(weights[i + 1])
            assert not non_finite(image)
            state_digest(image)
            encode_delta(images[i], image)
            whole.append(time.perf_counter() - t)
        result[name] = {"encode_ms": statistics.median(times) * 1e3, "version_ms": statistics.median(whole) * 1e3,
                        "payload_bytes": len(payload), "changed": round(1 - stats.sparsity, 3), "digest": digest.hexdigest()}
    print(json.dumps(result))


def run_tree(tree: Path, states_file: Path, repeats: int) -> dict[str, dict[str, float]]:
    got: dict[str, dict[str, float]] = run_child(__file__, tree, str(states_file), "--repeats", str(repeats),
                                                 env={"OMP_NUM_THREADS": "1"}, cwd=tempfile.gettempdir())
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="the source tree to compare with (e.g. a `git archive` of a commit)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30, help="encodes (and versions) timed per regime in each child")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.repeats)
        return
    trees = {"before": args.before.resolve(), "after": ROOT} if args.before else {"after": ROOT}
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        states_file = Path(tmp) / "states.pt"
        torch.save(versions(), states_file)
        runs = take_turns(trees, args.rounds, lambda tree: run_tree(tree, states_file, args.repeats))
    record: dict[str, dict[str, object]] = {}
    table = Table(title="a delta of the 1.08M-parameter Qwen2 (51 tensors), median over rounds")
    for col in ("regime", "values changed", "payload", "measure", *(f"{s} (ms)" for s in trees), "by round"):
        table.add_column(col)
    for name in REGIMES:
        first = runs["after"][0][name]
        digests = {run[name]["digest"] for side in runs for run in runs[side]}
        if len(digests) != 1:
            raise SystemExit(f"{name}: the trees' payloads or digests differ")
        record[name] = {"changed": first["changed"], "payload_bytes": first["payload_bytes"]}
        for measure, what in (("encode", "the delta encoded"), ("version", "image, check, digest, delta")):
            ms = {side: [run[name][f"{measure}_ms"] for run in runs[side]] for side in trees}
            record[name] |= {**{f"{side}_{measure}_ms": round(statistics.median(v), 2) for side, v in ms.items()},
                             **{f"{side}_{measure}_by_round": [round(x, 2) for x in v] for side, v in ms.items()}}
            table.add_row(name, f"{first['changed']:.1%}", f"{first['payload_bytes'] / 1e3:.0f} KB", what,
                          *(f"{statistics.median(v):.2f}" for v in ms.values()),
                          " / ".join(", ".join(f"{x:.1f}" for x in v) for v in ms.values()))
    console.print(table)
    print(json.dumps({"rounds": args.rounds, "repeats": args.repeats, "trees": {k: str(v) for k, v in trees.items()},
                      "regimes": record}))


if __name__ == "__main__":
    main()
