"""What a batch of the ``hf`` engine costs a node: its own decoding loop (``engines/sampler.py``) against transformers'
``generate``, in one process, the two taking turns on the same engine, model and requests.

- ``inprocess``: a version of ``recipes/arithmetic/inprocess.yaml`` (the TRL workload): 8 training prompts x 8
  samples, up to 4 new tokens, temperature 1, its 4-layer Qwen2 (1.08M parameters);
- ``agentic``: 4 prompts of about 200 bytes x 4 samples, 128 new tokens, top-p 0.95, a stop string, the same model
  with room for 512 positions: the long rows of a multi-turn recipe;
- ``sample``: drawing one token a row from 64 rows of the vocabulary (``torch.multinomial``, which ``generate``
  calls, against the loop's inverse CDF).

CPU time (``time.thread_time``) of the node's one torch thread, the median of ``--rounds`` rounds (a round: 10
in-process batches, one agentic batch, 200 draws a side), and the median of the rounds' ratios; the model's
weights are the recipe's initialisation (sampled lengths run to the budget on both paths). Both paths give the same
greedy tokens and logprobs and sample the same distribution (``tests/test_sampler.py``).

    python benchmarks/bench_sampler.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from astraflow.config import load_recipe
from astraflow.models import build_model, encode_prompt, load_tokenizer
from astraflow.rollout.engines import hf
from astraflow.rollout.engines.base import GenerationRequest, SamplingParams
from astraflow.rollout.engines.hf import HFEngine
from astraflow.rollout.engines.sampler import sample
from astraflow.tasks import load_split

ROOT = Path(__file__).resolve().parent.parent


def cpu_ms(fn: Callable[[], object], calls: int = 1) -> float:
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return 1e3 * (time.thread_time() - start) / calls


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a node's rollout.threads
    recipe = load_recipe(ROOT / "recipes" / "arithmetic" / "inprocess.yaml")
    policy = recipe.policies[recipe.primary]
    tok = load_tokenizer(policy.model.tokenizer)
    engine = HFEngine(build_model(policy.model, tok), tok)
    long = HFEngine(build_model(policy.model.model_copy(update={"max_positions": 512}), tok), tok)  # rows past 64 positions
    problems = load_split(recipe.data)[0]
    short = SamplingParams(max_new_tokens=recipe.rollout.max_new_tokens, temperature=1.0)
    workloads = {
        "inprocess": [GenerationRequest(encode_prompt(tok, p.prompt), short) for p in problems[:8] for _ in range(8)],
        "agentic": [GenerationRequest(encode_prompt(tok, " ".join(p.prompt for p in problems[k * 12:(k + 1) * 12])),
                                      SamplingParams(max_new_tokens=128, temperature=1.0, top_p=0.95, stop=("</tool>",)))
                    for k in range(4) for _ in range(4)],
    }
    logits = torch.randn(64, len(tok))
    by_itself = hf.runs_itself

    def side(loop: bool) -> dict[str, float]:
        hf.runs_itself = by_itself if loop else (lambda model: False)  # type: ignore[assignment]
        try:
            out = {"inprocess": cpu_ms(lambda: engine.generate(workloads["inprocess"]), 10),
                   "agentic": cpu_ms(lambda: long.generate(workloads["agentic"]))}
        finally:
            hf.runs_itself = by_itself  # type: ignore[assignment]
        probs = torch.softmax(logits, -1)
        out["sample"] = cpu_ms((lambda: sample(logits, short)) if loop else (lambda: torch.multinomial(probs, 1)), 200)
        return out

    for warm in (True, False):
        side(warm)
    rounds: dict[str, list[dict[str, float]]] = {"generate": [], "loop": []}
    for _ in range(args.rounds):
        rounds["generate"].append(side(False))
        rounds["loop"].append(side(True))
    out: dict[str, object] = {"rounds": args.rounds}
    table = Table(title="the hf engine's batch, CPU ms (median of rounds)")
    for col in ("path", "inprocess: 64 rows, 4 tokens", "agentic: 16 rows, 128 tokens", "one token of 64 rows"):
        table.add_column(col)
    for name, rs in rounds.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        out[name] = {k: round(v, 3) for k, v in med.items()}
        table.add_row(name, f"{med['inprocess']:.1f}", f"{med['agentic']:.0f}", f"{med['sample']:.3f}")
    ratio = {k: statistics.median(b[k] / a[k] for a, b in zip(rounds["generate"], rounds["loop"], strict=True)) for k in rs[0]}
    out["loop_over_generate"] = {k: round(v, 3) for k, v in ratio.items()}  # paired by round: the machine's drift cancels
    table.add_row("loop / generate, by round", *(f"{ratio[k]:.2f}" for k in ("inprocess", "agentic", "sample")))
    Console(stderr=True).print(table)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
