"""A recipe's own engine, loss and trainer backend, registered from ``rollout.plugins`` / ``trainer.plugins``
(tests/test_config_options.py).

``echo``: an engine that answers every prompt with its own last ``repeat`` tokens, each with
logprob ``logprob``. ``reinforce``: plain REINFORCE, L = -scale · A · log π_θ, token-mean over
the whole batch. Both have option models of their own, checked when the recipe loads.
``torch_twin``: the torch backend under another name, as a package's own backend would register.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field

from astraflow.registry import BACKENDS, ENGINES, LOSSES, Options
from astraflow.rollout.engines.base import Completion, GenerationRequest
from astraflow.train.batching import Tensors
from astraflow.train.losses.functional import AggMode, LossOutput, aggregate
from astraflow.train.losses.registry import PolicyLoss


class EchoOptions(Options):
    type: Literal["echo"] = "echo"
    repeat: int = Field(2, ge=1)
    """Tokens of the prompt's end each answer repeats."""
    logprob: float = Field(-0.5, le=0)


class EchoEngine:
    def __init__(self, options: EchoOptions) -> None:
        self.options = options
        self._version = -1

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        n, lp = self.options.repeat, self.options.logprob
        return [Completion(r.prompt_ids[-n:], [lp] * len(r.prompt_ids[-n:]), [self._version] * len(r.prompt_ids[-n:]), "stop")
                for r in requests]

    def load_state(self, state: Mapping[str, Any], version: int) -> None:
        self._version = version

    def state_view(self) -> Mapping[str, Any]:
        return {}


    def expect_callers(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
@ENGINES.register("echo", EchoOptions)
def build_echo(options: EchoOptions, model_cfg: Any, rollout_cfg: Any, tokenizer: Any) -> EchoEngine:
    return EchoEngine(options)


class ReinforceOptions(Options):
    type: Literal["reinforce"] = "reinforce"
    scale: float = Field(1.0, gt=0)


@LOSSES.register("reinforce", ReinforceOptions)
class Reinforce(PolicyLoss):
    options: ReinforceOptions

    def __call__(self, mb: Tensors, logprobs: torch.Tensor, keep: torch.Tensor | None, *, agg: AggMode,
                 n_tokens: float, n_seqs: float) -> LossOutput:
        adv = mb.advantages.to(logprobs.dtype)[:, None].expand_as(logprobs)  # (B, T)
        pg_loss = -self.options.scale * adv * logprobs  # (B, T)
        loss = aggregate(pg_loss, mb.mask, agg, n_tokens=n_tokens, n_seqs=n_seqs)
        return LossOutput(loss=loss, metrics={"reinforce_scale": self.options.scale})


@BACKENDS.register("torch_twin")
def torch_twin(model: torch.nn.Module, tokenizer: Any, cfg: Any, temperature: float = 1.0) -> Any:
    from astraflow.train.torch_backend import TorchBackend

    backend = TorchBackend(model, tokenizer, cfg, temperature=temperature)
    backend.registered_as = "torch_twin"  # type: ignore[attr-defined]
    return backend
