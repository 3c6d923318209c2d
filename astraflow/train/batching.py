"""Turn a wire ``Batch`` into padded tensors: prompt + completion rows, completion-aligned targets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astraflow.streams.messages import Batch


@dataclass
class Tensors:
    input_ids: torch.Tensor  # (B, L) prompt + completion, right-padded
    attention_mask: torch.Tensor  # (B, L)
    logit_index: torch.Tensor  # (B, T) position whose logits predict completion token t
    targets: torch.Tensor  # (B, T) completion token ids (0 where padded)
    behave_logprobs: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) 1 = trained token
    advantages: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (B,)
    versions: torch.Tensor  # (B, T)

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum().item())


def to_tensors(batch: Batch, pad_id: int) -> Tensors:
    trajs = batch.trajectories
    B = len(trajs)
    L = max(len(t.prompt_ids) // 4 + len(t.completion_ids) // 4 for t in trajs)
    T = max(max(len(t.completion_ids) // 4 for t in trajs), 1)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    idx = torch.zeros((B, T), dtype=torch.long)
    tgt = torch.zeros((B, T), dtype=torch.long)
    blp = torch.zeros((B, T), dtype=torch.float32)
    mask = torch.zeros((B, T), dtype=torch.float32)
    ver = torch.zeros((B, T), dtype=torch.long)
    for b, t in enumerate(trajs):
        p, c = torch.from_numpy(t.prompt_tokens().astype("int64")), torch.from_numpy(t.completion().astype("int64"))
        n_p, n_c = len(p), len(c)
        ids[b, : n_p + n_c] = torch.cat([p, c])
        att[b, : n_p + n_c] = 1
        idx[b, :n_c] = torch.arange(n_p - 1, n_p - 1 + n_c)
        tgt[b, :n_c] = c
        blp[b, :n_c] = torch.from_numpy(t.behaviour_logprobs().copy())
        mask[b, :n_c] = torch.from_numpy(t.mask().astype("float32"))
        ver[b, :n_c] = torch.from_numpy(t.token_versions().astype("int64"))
    adv = torch.from_numpy(batch.advantage_array().copy())
    rewards = torch.tensor([t.reward if t.reward is not None else 0.0 for t in trajs])
    return Tensors(ids, att, idx, tgt, blp, mask, adv, rewards, ver)
