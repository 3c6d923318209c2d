"""A batch's trajectories turned into the step's padded tensors (``train/batching.to_tensors``), two source trees side
by side on the same batches.

The trainer does this at the start of every step, on its own core, so its time is part of the step's. The batches
are the TRL workload's shape (``recipes/arithmetic/inprocess.yaml``: 8 prompts x 8 samples, up to 4 new tokens,
sampled from the recipe's model) and, for a longer-completion case, 16 prompts x 16 samples of up to 64 tokens. Each
tree builds them in a child process (``PYTHONPATH`` = the tree), the trees taking turns ``--rounds`` times; the
figure is the median over rounds of each child's median time. The tensors of both trees must be the same.

    python benchmarks/bench_to_tensors.py --before TREE [--rounds 4] [--repeats 200]

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_turns import cli, medians_side_by_side  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"TRL workload: 64 rows, <= 4 tokens": (8, 8, 4), "256 rows, <= 64 tokens": (16, 16, 64)}  # groups, size, tokens


def child(repeats: int) -> dict[str, dict[str, object]]:
    """In the tree on ``PYTHONPATH``: per shape, the median time of ``to_tensors`` and a digest of what it gives."""
    import hashlib
    import time

    import torch

    import astraflow
    from astraflow.config import load_recipe
    from astraflow.models import build_model, load_tokenizer
    from astraflow.tasks import load_split
    from astraflow.train.batching import to_tensors
    from astraflow.train.synthetic import sample_batches

    torch.set_num_threads(1)
    recipe = load_recipe(ROOT / "recipes" / "arithmetic" / "inprocess.yaml")
    pcfg = recipe.policies[recipe.primary]
    tok = load_tokenizer(pcfg.model.tokenizer)
    torch.manual_seed(0)
    model = build_model(pcfg.model, tok)
    prompts = [p.prompt for p in load_split(recipe.data)[0][:64]]
    out: dict[str, dict[str, object]] = {}
    for name, (groups, size, tokens) in SHAPES.items():
        batch = sample_batches(model, tok, prompts, groups_per_batch=groups, group_size=size, max_new_tokens=tokens,
                               seed=1)[0]
        x = to_tensors(batch, tok.pad_token_id)
        digest = hashlib.sha256()
        for t in (x.input_ids, x.attention_mask, x.logit_index, x.targets, x.behave_logprobs, x.mask, x.advantages,
                  x.rewards, x.versions, x.comp_lens):
            digest.update(str((t.dtype, tuple(t.shape))).encode() + t.contiguous().numpy().tobytes())
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            to_tensors(batch, tok.pad_token_id)
            times.append(time.perf_counter() - t0)
        out[name] = {"ms": 1000 * statistics.median(times), "digest": digest.hexdigest(), "rows": len(batch.trajectories)}
    out["tree"] = {"path": str(Path(astraflow.__file__).resolve().parent.parent)}
    return out


def main(before: Path, rounds: int, repeats: int) -> dict[str, object]:
    return medians_side_by_side(__file__, before, ROOT, rounds, repeats, SHAPES, same="digest",
                                title="to_tensors, median ms (by round)", label="shapes")


if __name__ == "__main__":
    cli(__doc__ or "", child, main)
