"""Mixture-of-Experts weights in the optimizer: what happens to an expert no token was routed to.

A Qwen3-MoE layer keeps its experts fused: ``mlp.experts.gate_up_proj`` (E, 2I, H) and
``mlp.experts.down_proj`` (E, H, I), expert e being row e. An expert that no token of the batch was
routed to gets an exactly zero gradient row, yet plain AdamW still moves it:

    m_t = β1 m_{t-1} + (1 - β1) g_t        (g_t = 0: m_t = β1 m_{t-1}, not 0 once the expert was ever routed)
    θ_t = θ_{t-1} - lr (m̂_t / (√v̂_t + ε) + λ θ_{t-1})   (momentum and weight decay λ both move it)

So its weights change and travel in the next delta. ``trainer.unrouted_experts: hold`` makes the
update lazy per expert (like SparseAdam / LazyAdam): the rows of a quiet expert keep their
weights and their AdamW moments through the step. The moments' bias correction stays the
tensor's (one step counter per tensor, not per expert).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # AdamW's per-element state (the last with amsgrad)


def expert_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The fused expert tensors of a model: parameters under ``.experts.``, experts along dimension 0."""
    return [p for name, p in module.named_parameters() if ".experts." in name and p.dim() == 3]


def quiet_experts(grad: torch.Tensor) -> torch.Tensor:
    """(E,) bool: the experts whose gradient row is exactly zero (no token was routed to them)."""
    return grad.flatten(1).abs().amax(dim=1) == 0


@contextlib.contextmanager
def hold_quiet_experts(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Around ``opt.step()``: the rows of quiet experts come out of the step as they went in (weights and moments)."""
    held: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = []
    for p in params:
        if p.grad is None:
            continue
        quiet = quiet_experts(p.grad)
        if quiet.any():
            state = opt.state.get(p, {})
            held.append((p, quiet, p.detach()[quiet].clone(), {k: state[k][quiet].clone() for k in MOMENTS if k in state}))
    yield
    with torch.no_grad():
        for p, quiet, weights, moments in held:
            p[quiet] = weights
            state = opt.state[p]
            for k in MOMENTS:
                if k in state:  # a moment the step created holds zeros for a quiet expert (its gradient was 0)
                    state[k][quiet] = moments.get(k, 0.0)
