"""Turn a batch (its trajectories in hand) into padded tensors, and split them into micro-batches by token budget.

A row is prompt + completion, right-padded to the longest row; per-token tensors are aligned
with the completion (T = longest completion), the recorded MoE routing with the row (``routing``).
A micro-batch is a subset of rows, trimmed to its own longest row, so padding does not grow
with the batch's outliers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from astraflow.streams.messages import Trajectory
from astraflow.streams.trajectories import TrainingBatch


@dataclass
class Tensors:
    input_ids: torch.Tensor  # (B, L) prompt + completion, right-padded
    attention_mask: torch.Tensor  # (B, L)
    logit_index: torch.Tensor  # (B, T) position whose logits predict completion token t
    targets: torch.Tensor  # (B, T) completion token ids (0 where padded)
    behave_logprobs: torch.Tensor  # (B, T) log π_behave, from the rollout engine
    mask: torch.Tensor  # (B, T) 1 = trained token
    advantages: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (B,)
    versions: torch.Tensor  # (B, T) weight version that sampled each token
    comp_lens: torch.Tensor  # (B,) completion length of each row
    rows: torch.Tensor  # (B,) index of each row in the full batch
    routing: torch.Tensor | None = None  # (B, L, layers, k) experts the engine routed each position to, -1: not recorded

    @property
    def n_tokens(self) -> int:
        """Counted (masked-in) tokens."""
        return int(self.mask.sum().item())

    @property
    def padded_tokens(self) -> int:
        """Tokens one forward pass processes (rows x padded length)."""
        return int(self.input_ids.numel())

    def select(self, rows: list[int]) -> Tensors:
        """The given rows, trimmed to their longest row and longest completion."""
        idx = torch.tensor(rows, dtype=torch.long)
        L = max(int(self.attention_mask[idx].sum(-1).max()), 1)
        T = max(int(self.comp_lens[idx].max()), 1)
        out: dict[str, Any] = {}
        for f in fields(self):
            if getattr(self, f.name) is None:
                out[f.name] = None
                continue
            t = getattr(self, f.name)[idx]
            if f.name in ("input_ids", "attention_mask", "routing"):
                t = t[:, :L]
            elif t.dim() == 2:
                t = t[:, :T]
            out[f.name] = t
        return Tensors(**out)

    def to(self, device: str | torch.device) -> Tensors:
        moved: dict[str, Any] = {f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device) for f in fields(self)}
        return Tensors(**moved)


def to_tensors(batch: TrainingBatch, pad_id: int, routing: tuple[int, int, int] | None = None) -> Tensors:
    """``routing``: the model's (MoE layers, top-k, experts), to take the routing the trajectories recorded in that
    layout (rows of another, or with none, stay -1: routed by the model itself).

    The batch's arrays are concatenated once and scattered into place by (row, column): a few numpy passes whatever
    the rows, where filling row by row cost a dozen tensor writes a row."""
    trajs = batch.trajectories
    B = len(trajs)
    prompts = [t.prompt_tokens() for t in trajs]
    comps = [t.completion() for t in trajs]
    n_p = np.array([len(p) for p in prompts], dtype=np.int64)  # (B,)
    n_c = np.array([len(c) for c in comps], dtype=np.int64)  # (B,)
    n_row = n_p + n_c  # (B,) tokens of each row
    L, T = int(n_row.max()), max(int(n_c.max()), 1)
    r, col = _places(n_row)  # every token of every row: prompt, then completion
    ids = np.full((B, L), pad_id, dtype=np.int64)
    ids[r, col] = np.concatenate([a for p, c in zip(prompts, comps, strict=True) for a in (p, c)])
    att = (np.arange(L)[None, :] < n_row[:, None]).astype(np.int64)  # (B, L)
    cr, ct = _places(n_c)  # every completion token: (row, t)

    def per_token(values: np.ndarray, dtype: type) -> torch.Tensor:  # (B, T), 0 where padded
        out: np.ndarray = np.zeros((B, T), dtype=dtype)
        out[cr, ct] = values
        return torch.from_numpy(out)

    idx = per_token(n_p[cr] - 1 + ct, np.int64)  # the position whose logits predict completion token t
    tgt = per_token(np.concatenate(comps), np.int64)
    blp = per_token(np.concatenate([t.behaviour_logprobs() for t in trajs]), np.float32)
    mask = per_token(np.concatenate([t.mask() for t in trajs]), np.float32)
    ver = per_token(np.concatenate([t.token_versions() for t in trajs]), np.int64)
    adv = torch.from_numpy(batch.advantage_array().copy())
    rewards = torch.tensor([t.reward if t.reward is not None else 0.0 for t in trajs])
    routes = routing_tensor(trajs, L, routing) if routing else None
    return Tensors(torch.from_numpy(ids), torch.from_numpy(att), idx, tgt, blp, mask, adv, rewards, ver,
                   torch.from_numpy(n_c), torch.arange(B), routes)


def _places(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each item of rows laid end to end, row b holding ``lengths[b]`` items from column 0."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths  # where each row begins in the concatenation
    return rows, np.arange(len(rows)) - starts[rows]


def first_predicting(x: Tensors) -> int:
    """The first position whose logits predict a completion token of any row (0 when no row has one)."""
    real = torch.arange(x.logit_index.shape[1], device=x.comp_lens.device)[None, :] < x.comp_lens[:, None]  # (B, T)
    return int(x.logit_index[real].min()) if bool(real.any()) else 0


def routing_tensor(trajs: list[Trajectory], width: int, shape: tuple[int, int, int]) -> torch.Tensor | None:
    """(B, width, layers, k) int32 of the routing recorded in the layout ``shape`` (layers, k, experts), -1 where none;
    None when no trajectory recorded any."""
    layers, k, _ = shape
    if not any(t.routing_layout is not None for t in trajs):
        return None
    out = torch.full((len(trajs), width, layers, k), -1, dtype=torch.int32)
    for b, t in enumerate(trajs):
        layout, ids = t.routing_layout, t.routes()
        if layout is not None and ids is not None and (layout.layers, layout.top_k, layout.experts) == shape:
            out[b, : len(ids)] = torch.from_numpy(ids.astype("int32"))
    return out


def micro_batches(x: Tensors, token_budget: int | None) -> list[Tensors]:
    """Split ``x`` into micro-batches of at most ``token_budget`` padded tokens each.

    Rows are taken longest first (stable, so the split is deterministic) and packed greedily:
    a micro-batch of n rows whose longest row has l tokens costs n x l. A row longer than the
    budget goes alone. ``None`` keeps the whole batch in one pass.
    """
    if token_budget is None:
        return [x]
    lengths = x.attention_mask.sum(-1).tolist()
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    groups: list[list[int]] = []
    for r in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(r)
        else:
            groups.append([r])
    return [x.select(sorted(g)) for g in groups]
