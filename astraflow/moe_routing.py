"""Mixture-of-Experts routing: record the experts each token was routed to in the engine, replay them in the trainer.

A MoE layer's router sends each token to its top-k experts by p = softmax(h·W_r). The rollout engine and the
trainer compute h from weights that differ (the node holds the published bf16 image, the trainer its fp32
masters), in other batch shapes and kernels. Top-k is discontinuous: a token near a tie goes to other experts
in the trainer, and the ratio π_θ/π_behave then measures routing noise as well as policy change. Routing
replay: the engine records, per input position and MoE layer, the k experts it chose; the trainer forces
them when it recomputes logprobs and takes the step, weighting the forced experts by its own router, so the
router still learns:

    forced experts e_1..e_k:   w_j = p[e_j] / Σ_i p[e_i]   (norm_topk_prob; else w_j = p[e_j])

Routers are the modules transformers' MoE models route with, which return ``(logits, scores, indices)``
(Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE: softmax then top-k). Position p is the p-th token of prompt +
completion; a completion of C tokens after a prompt of P has P + C - 1 routed positions (its last token is
never an input whose routing shapes a logprob). On the wire (``messages.Trajectory.routing``) the ids are
(positions, layers, k), uint8 when the layer has at most 256 experts, else little-endian uint16.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from astraflow.streams.messages import expert_id_dtype

if TYPE_CHECKING:
    import torch

@dataclass(frozen=True)
class Routes:
    """The experts an engine routed one sequence's positions to: ``ids`` (positions, layers, k) of ``experts``."""

    ids: np.ndarray
    experts: int

    @property
    def positions(self) -> int:
        return int(self.ids.shape[0])

    def head(self, n: int) -> Routes:
        return Routes(self.ids[:n], self.experts)

    def packed(self) -> bytes:
        return np.ascontiguousarray(self.ids, expert_id_dtype(self.experts)).tobytes()


def find_routers(model: Any) -> list[Any]:
    """The model's routers in layer order: modules with ``top_k`` and ``num_experts`` whose class is a router."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("Router") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def require_routers(model: Any, what: str) -> list[Any]:
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{what} needs a Mixture-of-Experts model whose routers return (logits, scores, indices) "
                         f"(Qwen2/Qwen3-MoE, Mixtral, OLMoE); {type(model).__name__} has none")
    if len({(r.top_k, r.num_experts) for r in routers}) > 1:
        raise ValueError(f"{what}: every MoE layer must route to the same top-k of the same number of experts")
    return routers


def routing_shape(model: Any) -> tuple[int, int, int]:
    """(MoE layers, top-k, experts) of the model (ValueError when it has no routers)."""
    routers = require_routers(model, "routing")
    return len(routers), int(routers[0].top_k), int(routers[0].num_experts)


class RoutingRecorder:
    """Records what a model's routers choose during a generation (the engine held, one generation at a time).

    The ``hf`` engine's decoding run (its loop, or ``generate``) runs one prefill over the left-padded batch (B·W
    positions) and then one forward per decoding step (B positions); :meth:`rows` cuts them into each row's positions.
    """

    def __init__(self, model: Any) -> None:
        routers = require_routers(model, "recording routing")
        self.top_k, self.experts = int(routers[0].top_k), int(routers[0].num_experts)
        self.calls: list[list[torch.Tensor]] = [[] for _ in routers]  # per router: one (N, k) per forward
        for i, r in enumerate(routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            self.calls[i].append(output[2].detach())
        return hook

    def start(self) -> None:
        for c in self.calls:
            c.clear()

    def rows(self, lengths: list[int], width: int) -> list[Routes]:
        """Each row's routes: its ``lengths[i]`` context positions (right-aligned in the prefill of ``width``), then one
        per decoding step; a row that ended before the others has steps past its end (cut them: :meth:`Routes.head`)."""
        import torch

        B = len(lengths)
        per_layer = []
        for calls in self.calls:  # (B·W, k) prefill, then (B, k) per step
            prefill = calls[0].reshape(B, width, -1)
            steps = torch.stack(calls[1:], dim=1) if len(calls) > 1 else prefill[:, :0]  # (B, S, k)
            per_layer.append((prefill, steps))
        out = []
        for i, n in enumerate(lengths):
            layers = [torch.cat([pre[i, width - n:], steps[i]]) for pre, steps in per_layer]
            ids = torch.stack(layers, dim=1).cpu().numpy()  # (positions, layers, k)
            out.append(Routes(ids.astype(expert_id_dtype(self.experts)), self.experts))
        return out


@dataclass
class RoutingCounts:
    """Routed (position, layer) pairs that had a recorded routing, and those whose own top-k set differed from it."""

    recorded: torch.Tensor
    mismatched: torch.Tensor

    def share(self) -> float:
        n = float(self.recorded)
        return float(self.mismatched) / n if n else 0.0


@contextmanager
def routed(model: Any, forced: torch.Tensor | None, replay: bool) -> Iterator[RoutingCounts | None]:
    """Run ``model`` within the block with the recorded routing ``forced`` (b, l, layers, k) in hand, -1 where no
    routing was recorded (padding, a node that records none). It counts the positions whose own top-k set differs
    from the recorded one; with ``replay`` the routers take the recorded experts, weighted by their own softmax
    (the module's comment). The model's input must be (b, l): a router sees its b·l positions in that order."""
    if forced is None:
        yield None
        return
    import torch

    routers = require_routers(model, "routing replay")
    if forced.shape[2:] != (len(routers), routers[0].top_k):
        raise ValueError(f"routing replay: recorded routing of {forced.shape[2]} layers x top-{forced.shape[3]}, the model "
                         f"routes {len(routers)} layers x top-{routers[0].top_k}")
    counts = RoutingCounts(forced.new_zeros((), dtype=torch.long), forced.new_zeros((), dtype=torch.long))
    k = forced.shape[-1]

    def hook_for(layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> Any:
            logits, scores, own = output
            want = forced[:, :, layer].reshape(-1, k).to(own.device)  # (N, k)
            if want.shape[0] != own.shape[0]:
                raise ValueError(f"routing replay: the router saw {own.shape[0]} positions, the recorded routing has "
                                 f"{want.shape[0]}")
            known = (want >= 0).all(-1) & (want < module.num_experts).all(-1)  # the dataflow checked; an id beyond is free
            differs = (own.sort(-1).values != want.sort(-1).values).any(-1) & known
            counts.recorded += known.sum()
            counts.mismatched += differs.sum()
            if not replay:
                return None
            ids = torch.where(known[:, None], want.long(), own)
            weights = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
            if getattr(module, "norm_topk_prob", True):
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(scores.dtype), ids
        return hook

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()
