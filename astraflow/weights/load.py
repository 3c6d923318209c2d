"""Loading a whole state into a module's own tensors, in place (the engine and the trainer keep their parameters, so
nothing that holds them, an optimizer or a compiled graph, goes stale)."""

from __future__ import annotations

from collections.abc import Mapping

import torch


@torch.no_grad()
def copy_weights(module: torch.nn.Module, state: Mapping[str, torch.Tensor], what: str = "weights") -> None:
    """Copy ``state`` into every tensor of ``module``'s state dict; ``ValueError`` naming ``what`` and the first tensors
    it lacks, before anything is copied."""
    own = module.state_dict()
    missing = set(own) - set(state)
    if missing:
        raise ValueError(f"{what}: {len(missing)} tensors missing, among them {sorted(missing)[:3]}")
    for name, tensor in own.items():
        tensor.copy_(state[name])
