"""Small per-version costs on the trainer's and the launcher's paths, two source trees side by side on the same inputs:

- **a version's image checked finite** (``weights/finite.non_finite``): the trainer checks the bf16 image of each
  version on its own core, outside its step (``recipes/arithmetic/inprocess.yaml``'s 1.08M-parameter Qwen2: 51 tensors);
- **a batch's token ids checked** (``train/vetting.check_batch``): before each step, every trajectory of the batch
  (the recipe's: 8 prompts x 8 samples of up to 4 new tokens, sampled from its model);
- **the weights' retention planned** (``weights/retention.plan_retention``): after each announcement, on the trainer's
  event loop; a history of 75 announcements, a keyframe every 10, the 64 newest versions kept (the defaults);
- **the dataflow's state read back** (``DataflowState.decode``): the launcher reads it after each turn that brought
  announcements, several times a second in ``up``. The state is one as a run writes it at steady state: 256 batches of
  history, a batch plan of 64 trajectories, 8 tasks written ahead, 8 in flight (about 15 KB of JSON).

Each tree runs in a child process (``PYTHONPATH`` = the tree), one thread, the trees taking turns ``--rounds`` times;
the figure is the median over rounds of each child's median time. Both trees must give the same answers (the names of
the non-finite tensors of a clean and a poisoned image; the refusals of a clean batch and of one with a token out of the
vocabulary; the announcements kept and deleted; the decoded state).

    python benchmarks/bench_checks_and_reads.py --before TREE [--rounds 4] [--repeats 200]

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_turns import cli, medians_side_by_side  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CASES = ("image checked finite", "batch token ids checked", "retention planned", "dataflow state decoded")


def steady_state_json() -> bytes:
    """A dataflow state as a run writes it at steady state, built with the tree's own models."""
    from astraflow.streams.dataflow_state import BatchPlan, DataflowState, LaneState, LedgerState, TaskState
    from astraflow.streams.messages import Task, TrajRef

    tasks = [Task(task_id=f"t{n:08d}", workflow="single_turn", policy="solver", prompt_id=f"add-{n % 90 + 10}-{n % 89 + 10}",
                  prompt=f"{n % 90 + 10}+{n % 89 + 10}=", group_size=8, meta={"answer": str(n % 90 + n % 89 + 20)},
                  min_versions={"solver": 250}, created_at=1.7e9 + n) for n in range(2135, 2143)]
    plan = BatchPlan(batch_id="solver-b000251", tasks=[f"t{n:08d}" for n in range(2119, 2127)],
                     groups=[f"t{n:08d}" for n in range(2119, 2127)],
                     refs=[TrajRef(seq=17000 + i, traj_id=f"t{2119 + i // 8:08d}.solver.{i % 8}", task_id=f"t{2119 + i // 8:08d}")
                           for i in range(64)], advantages=[0.35, -0.35] * 32, created_at=1.7e9)
    lane = LaneState(batch_seq=251, ledger=LedgerState(issued=2142, received=2120, samples=16960, fates={"trained": 1990}),
                     pipeline={"curators": [{"name": "accept_all", "state": {}}], "server": [{"name": "fifo", "state": {}}],
                               "advantage": [{"name": "grpo", "state": {}}]},
                     plans={plan.batch_id: plan}, awaiting={plan.batch_id: list(plan.tasks)},
                     history=[[float(b), 8.0 * b + 1, 8.0 * b + 8, float(b % 2), 0.5 * (b % 2)] for b in range(1, 257)],
                     followed=250)
    state = DataflowState(tasks=TaskState(task_seq=2142, cursor=2142, in_flight={t.task_id: None for t in tasks},
                                          floors=[(2127, {"solver": 250})], issuing=tasks), lanes={"solver": lane})
    return state.encode()


def announcements(n: int = 75, keyframe_every: int = 10) -> list[Any]:
    """A policy's history of ``n`` announcements, a keyframe every ``keyframe_every``, built with the tree's models."""
    from astraflow.streams.messages import ObjectRef, WeightVersion

    out = []
    for v in range(n):
        digest = f"{v:064x}"
        ref = ObjectRef(name=f"solver/v{v}", nuid=f"n{v}", size=1, chunk_size=1, digests=[digest], digest=digest)
        base = {} if v % keyframe_every == 0 else {"base_version": v - 1, "base_digest": f"{v - 1:064x}"}
        out.append(WeightVersion(policy="solver", version=v, encoding="delta" if base else "keyframe", state_digest=digest,
                                 keyframe_version=v - v % keyframe_every, objects=[ref], **base))
    return out


def child(repeats: int) -> dict[str, dict[str, object]]:
    """In the tree on ``PYTHONPATH``: per case, the median time and what it answers."""
    import hashlib
    import math
    import time

    import numpy as np
    import torch

    import astraflow
    from astraflow.config import load_recipe
    from astraflow.models import build_model, load_tokenizer
    from astraflow.streams.dataflow_state import DataflowState
    from astraflow.streams.trajectories import TrainingBatch
    from astraflow.tasks import load_split
    from astraflow.train.synthetic import sample_batches
    from astraflow.train.vetting import check_batch
    from astraflow.weights.delta import to_bf16_state
    from astraflow.weights.finite import non_finite
    from astraflow.weights.retention import plan_retention

    torch.set_num_threads(1)
    recipe = load_recipe(ROOT / "recipes" / "arithmetic" / "inprocess.yaml")
    pcfg = recipe.policies[recipe.primary]
    torch.manual_seed(0)
    tok = load_tokenizer(pcfg.model.tokenizer)
    model = build_model(pcfg.model, tok)
    image = to_bf16_state(model.state_dict())
    poisoned = {k: v.clone() for k, v in image.items()}
    poisoned[list(poisoned)[7]].view(-1)[3] = math.nan
    data = steady_state_json()
    history = announcements()
    planned = plan_retention(history, 64)
    batch = sample_batches(model, tok, [p.prompt for p in load_split(recipe.data)[0][:64]], groups_per_batch=8, group_size=8,
                           max_new_tokens=4, seed=1)[0]
    last = batch.trajectories[-1]
    poisoned_batch = TrainingBatch(batch.manifest, [*batch.trajectories[:-1], last.model_copy(
        update={"completion_ids": np.array([len(tok) + 5], "<i4").tobytes()})])

    def refusal(b: TrainingBatch) -> str:
        r = check_batch(b, len(tok), 0, 10)
        return "" if r is None else r.reason

    def median_ms(f: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times)

    answers = {"image checked finite": json.dumps([non_finite(image), non_finite(poisoned)]),
               "batch token ids checked": json.dumps([refusal(batch), refusal(poisoned_batch)]),
               "retention planned": json.dumps([[a.version for a in planned.keep], [a.version for a in planned.delete]]),
               "dataflow state decoded": DataflowState.decode("dataflow", data).model_dump_json(exclude={"ts"})}
    out: dict[str, dict[str, object]] = {
        "image checked finite": {"ms": median_ms(lambda: non_finite(image)), "size": sum(t.numel() for t in image.values())},
        "batch token ids checked": {"ms": median_ms(lambda: check_batch(batch, len(tok), 0, 10)), "size": len(batch.trajectories)},
        "retention planned": {"ms": median_ms(lambda: plan_retention(history, 64)), "size": len(history)},
        "dataflow state decoded": {"ms": median_ms(lambda: DataflowState.decode("dataflow", data)), "size": len(data)},
    }
    for case in CASES:
        out[case]["answer"] = hashlib.sha256(answers[case].encode()).hexdigest()
    out["tree"] = {"path": str(Path(astraflow.__file__).resolve().parent.parent)}
    return out


def main(before: Path, rounds: int, repeats: int) -> dict[str, object]:
    return medians_side_by_side(__file__, before, ROOT, rounds, repeats, CASES, same="answer",
                                title="median ms per call (by round)", label="cases", size="size")


if __name__ == "__main__":
    cli(__doc__ or "", child, main)
