"""Policy losses by name, in the loss registry (``astraflow.registry.LOSSES``); ``build_loss`` builds the
one ``trainer.loss`` names. The trainer's objective calls it without knowing which.

A loss is a :class:`PolicyLoss`: ``keep_mask`` (optional) chooses the tokens of the whole batch a
step trains on, before any micro-batch; ``__call__`` is the loss of one micro-batch, normalised by
the whole batch's kept-token (or sequence) counts. A plug-in loss registers the same way from a
module in ``trainer.plugins``, imported before the recipe is validated, or from a package's entry point
in the group ``astraflow.loss``:

    class ScaledPgOptions(Options):
        type: Literal["scaled_pg"] = "scaled_pg"
        scale: float = 1.0

    @LOSSES.register("scaled_pg", ScaledPgOptions)
    class ScaledPg(PolicyLoss):
        def __call__(self, mb, logprobs, keep, *, agg, n_tokens, n_seqs) -> LossOutput: ...
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from astraflow.registry import LOSSES, Options
from astraflow.train.batching import Tensors
from astraflow.train.losses.functional import AggMode, LossOutput, decoupled_ppo_loss, m2po_loss, m2po_mask, ppo_clip_loss
from astraflow.train.losses.options import DecoupledPpoOptions, M2poOptions, PpoOptions


class PolicyLoss(ABC):
    """One registered policy loss, built as ``Loss(options)``. Tensors are (B, T) over completion tokens."""

    needs_batch_logprobs: ClassVar[bool] = False
    """True when ``keep_mask`` needs log π_θ of the whole batch before any backward (a statistic of the batch)."""

    def __init__(self, options: Any) -> None:
        self.options = options

    def keep_mask(self, batch: Tensors, logprobs: torch.Tensor | None) -> torch.Tensor | None:
        """(B, T) bool over the whole batch: the tokens this step trains on; None keeps every counted token."""
        return None

    @abstractmethod
    def __call__(self, mb: Tensors, logprobs: torch.Tensor, keep: torch.Tensor | None, *, agg: AggMode,
                 n_tokens: float, n_seqs: float) -> LossOutput:
        """Loss of micro-batch ``mb``: ``logprobs`` (b, t) log π_θ, differentiable; ``keep`` (b, t) its slice of
        ``keep_mask``; ``n_tokens`` / ``n_seqs`` the whole batch's kept counts (the normaliser)."""


def build_loss(options: Options) -> PolicyLoss:
    loss: type[PolicyLoss] = LOSSES.get(options.type)
    return loss(options)


@LOSSES.register("ppo", PpoOptions)
class Ppo(PolicyLoss):
    options: PpoOptions

    def __call__(self, mb: Tensors, logprobs: torch.Tensor, keep: torch.Tensor | None, *, agg: AggMode,
                 n_tokens: float, n_seqs: float) -> LossOutput:
        o = self.options
        return ppo_clip_loss(logprobs, mb.behave_logprobs, mb.advantages, mb.mask, clip_low=o.clip_low, clip_high=o.clip_high,
                             dual_clip=o.dual_clip, agg=agg, n_tokens=n_tokens, n_seqs=n_seqs)


@LOSSES.register("decoupled_ppo", DecoupledPpoOptions)
class DecoupledPpo(PolicyLoss):
    options: DecoupledPpoOptions

    def __call__(self, mb: Tensors, logprobs: torch.Tensor, keep: torch.Tensor | None, *, agg: AggMode,
                 n_tokens: float, n_seqs: float) -> LossOutput:
        o = self.options
        # one optimizer step per batch: π_θ before the step is this forward's own logprobs
        prox = logprobs.detach() if o.recompute_prox else None
        return decoupled_ppo_loss(logprobs, prox, mb.behave_logprobs, mb.advantages, mb.mask, clip_low=o.clip_low,
                                  clip_high=o.clip_high, tis_cap=o.tis_cap, agg=agg, n_tokens=n_tokens, n_seqs=n_seqs)


@LOSSES.register("m2po", M2poOptions)
class M2po(PolicyLoss):
    options: M2poOptions
    needs_batch_logprobs = True  # the mask is a statistic of the whole batch

    def keep_mask(self, batch: Tensors, logprobs: torch.Tensor | None) -> torch.Tensor | None:
        if logprobs is None:
            raise ValueError("m2po needs the full batch's logprobs to plan a step")
        dev = logprobs.device
        return m2po_mask(logprobs, batch.behave_logprobs.to(dev), batch.advantages.to(dev), batch.mask.to(dev),
                         tau=self.options.tau)  # (B, T)

    def __call__(self, mb: Tensors, logprobs: torch.Tensor, keep: torch.Tensor | None, *, agg: AggMode,
                 n_tokens: float, n_seqs: float) -> LossOutput:
        if keep is None:
            raise ValueError("m2po trains on the slice of its whole-batch keep mask; plan the step first")
        return m2po_loss(logprobs, mb.behave_logprobs, mb.advantages, mb.mask, tau=self.options.tau, keep_mask=keep, agg=agg,
                         n_tokens=n_tokens, n_seqs=n_seqs)
