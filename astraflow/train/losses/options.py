"""Options of the built-in policy losses: what ``trainer.loss`` may hold, one model per loss.

Light on purpose (pydantic only): every role validates a recipe against these
(``astraflow.registry.LOSSES`` imports this module). A field another loss owns fails at
load (``tau`` on ``ppo``). The maths is in ``functional.py``.

    loss: ppo
    loss: {type: decoupled_ppo, tis_cap: 2.0, recompute_prox: true}
    loss: {type: m2po, tau: 0.004}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from astraflow.registry import LOSSES, Options


class ClipOptions(Options):
    """The PPO-clip trust region the clipped losses share: r is kept within [1 - clip_low, 1 + clip_high]."""

    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    """Above clip_low: clip-higher (DAPO), room for low-probability tokens to rise."""


@LOSSES.declare
class PpoOptions(ClipOptions):
    """PPO-clip against the behaviour logprobs, with clip-higher and dual-clip."""

    type: Literal["ppo"] = "ppo"
    dual_clip: float | None = Field(3.0, gt=1)
    """Bound on the loss of A < 0 tokens with a huge ratio (Ye et al.); null disables it."""


@LOSSES.declare
class DecoupledPpoOptions(ClipOptions):
    """Decoupled PPO: trust region around π_prox, truncated importance sampling against π_behave."""

    type: Literal["decoupled_ppo"] = "decoupled_ppo"
    tis_cap: float | None = Field(2.0, gt=0)
    """Truncation of the IS weight π_prox/π_behave; null: untruncated."""
    recompute_prox: bool = False
    """π_prox = the trainer's policy before this step (its own logprobs, detached), instead of π_behave.
    With one optimizer step per batch this costs no extra forward pass."""


@LOSSES.declare
class M2poOptions(Options):
    """M2PO: a second-moment mask over the whole batch is the trust region; no ratio clip."""

    type: Literal["m2po"] = "m2po"
    tau: float = Field(0.01, gt=0)
    """Bound on the mean (log π_θ/π_behave)² of the kept tokens, over the whole batch."""
