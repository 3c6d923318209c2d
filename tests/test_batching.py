"""A batch's trajectories as padded tensors (``to_tensors``), built in a few array passes: each tensor equals the one
filled row by row, the definition, on ragged rows (prompts and completions of several lengths, an empty completion,
tokens masked out, several weight versions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from factories import sampled_batches

from astraflow.streams.messages import Trajectory
from astraflow.streams.trajectories import TrainingBatch
from astraflow.train.batching import to_tensors

PAD = 7


def by_row(batch: TrainingBatch, pad_id: int) -> dict[str, torch.Tensor]:
    """The padded tensors, one row at a time."""
    trajs = batch.trajectories
    rows = [(t.prompt_tokens().tolist(), t.completion().tolist()) for t in trajs]
    L = max(len(p) + len(c) for p, c in rows)
    T = max(max(len(c) for _, c in rows), 1)
    out = {"input_ids": torch.full((len(trajs), L), pad_id), "attention_mask": torch.zeros(len(trajs), L, dtype=torch.long)}
    out |= {k: torch.zeros(len(trajs), T, dtype=torch.long) for k in ("logit_index", "targets", "versions")}
    out |= {k: torch.zeros(len(trajs), T) for k in ("behave_logprobs", "mask")}
    for b, (t, (p, c)) in enumerate(zip(trajs, rows, strict=True)):
        for j, tok in enumerate(p + c):
            out["input_ids"][b, j], out["attention_mask"][b, j] = tok, 1
        for j, tok in enumerate(c):
            out["logit_index"][b, j], out["targets"][b, j] = len(p) - 1 + j, tok
            out["behave_logprobs"][b, j] = float(t.behaviour_logprobs()[j])
            out["mask"][b, j], out["versions"][b, j] = float(t.mask()[j]), int(t.token_versions()[j])
    out["comp_lens"] = torch.tensor([len(c) for _, c in rows])
    return out


def ragged(batch: TrainingBatch) -> TrainingBatch:
    """``batch`` with its second row's completion empty, its first's prompt longer by three tokens, every other row's
    last token masked out and versions that differ by token."""
    trajs = []
    for i, t in enumerate(batch.trajectories):
        c = t.completion()
        n = 0 if i == 1 else len(c)
        update = {"completion_ids": c[:n].astype("<i4").tobytes(), "logprobs": t.behaviour_logprobs()[:n].astype("<f4").tobytes(),
                  "versions": (np.arange(n) % 3 + i).astype("<i4").tobytes(),
                  "loss_mask": np.array([0 if (i % 2 and j == n - 1) else 1 for j in range(n)], "<u1").tobytes()}
        if i == 0:
            update["prompt_ids"] = np.concatenate([t.prompt_tokens(), [40, 41, 42]]).astype("<i4").tobytes()
        trajs.append(Trajectory.model_validate({**t.model_dump(), **update}))
    return TrainingBatch(batch.manifest, trajs)


@pytest.fixture(scope="module")
def sampled() -> TrainingBatch:
    return sampled_batches({"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
                           1, seed=5)[2][0]


@pytest.mark.parametrize("shape", ["sampled", "ragged"])
def test_the_padded_tensors_are_the_rows_filled_one_by_one(sampled, shape):
    batch = sampled if shape == "sampled" else ragged(sampled)
    x = to_tensors(batch, PAD)
    want = by_row(batch, PAD)
    assert len({len(t.completion()) for t in batch.trajectories}) > 2  # rows of several lengths
    for name, expected in want.items():
        got = getattr(x, name)
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    assert torch.equal(x.advantages, torch.from_numpy(batch.advantage_array().copy()))
    assert torch.equal(x.rows, torch.arange(len(batch.trajectories)))
    assert x.n_tokens == sum(int(t.mask().sum()) for t in batch.trajectories)
