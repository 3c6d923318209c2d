"""The trainer-backend contract and the registry that picks one by ``trainer.backend``.

A backend registers a factory, ``factory(model, tokenizer, cfg, temperature) -> TrainerBackend``, that
imports its packages only when called (deepspeed is an optional extra); a package outside the
repository may add one through an entry point in the group ``astraflow.backend``.

A backend owns the model being trained, its optimizer and how a step runs on the hardware.
The worker only sees this Protocol: it feeds batches, publishes ``state_dict_bf16()`` and
saves / loads checkpoints through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from astraflow.registry import BACKENDS

if TYPE_CHECKING:
    import torch

    from astraflow.config import TrainerConfig
    from astraflow.streams.trajectories import TrainingBatch


class TrainerBackend(Protocol):
    rank: int  # this process's rank (0 talks to the plane)
    world_size: int  # processes training together (data parallel)
    device: torch.device  # where it trains
    suspects: dict[int, float]  # the last step's rows (batch order) the token check left out -> their logprob gap, every rank's

    def step(self, batch: TrainingBatch) -> dict[str, float]:
        """One optimizer step on the whole batch (micro-batches accumulate); returns its metrics."""

    def state_dict_bf16(self) -> dict[str, torch.Tensor]:
        """The full weights as contiguous CPU bf16 tensors: what a weight version publishes.
        A collective call when the weights are sharded (every rank must call it)."""

    def base_bf16(self) -> dict[str, torch.Tensor] | None:
        """The frozen base weights (bf16) a LoRA model's versions are adapters of (``trainer.lora.announce: adapter``), or
        None when a version is the full weights. A collective call when the weights are sharded."""

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the trained weights (any float dtype; a LoRA model's adapters when ``state`` is adapters), keeping
        the optimizer state."""

    def reference_state(self) -> dict[str, torch.Tensor] | None:
        """The frozen reference policy's weights (KL penalty), or None without one."""

    def load_reference(self, state: Mapping[str, torch.Tensor]) -> None: ...

    def save(self, path: Path) -> None:
        """Write weights (safetensors) and optimizer state under the existing directory ``path``."""

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote."""

    def retune(self) -> dict[str, tuple[float, float]]:
        """Set the optimizer's learning rate and weight decay to the recipe's (a checkpoint restores those it was trained
        with); those that changed, as (was, now)."""

    def snapshot(self) -> Callable[[Path], None] | None:
        """Copy what :meth:`save` writes, now; the returned writer writes that copy later, from any thread, while
        training goes on. None when the backend can only save synchronously (DeepSpeed: a collective save)."""


BackendFactory = Callable[..., TrainerBackend]
"""``factory(model, tokenizer, cfg, temperature=...)``: a backend for the model being trained."""


@BACKENDS.register("torch")
def torch_backend(model: torch.nn.Module, tokenizer: Any, cfg: TrainerConfig, temperature: float = 1.0) -> TrainerBackend:
    from astraflow.train.torch_backend import TorchBackend

    return TorchBackend(model, tokenizer, cfg, temperature=temperature)


@BACKENDS.register("deepspeed")
def deepspeed_backend(model: torch.nn.Module, tokenizer: Any, cfg: TrainerConfig, temperature: float = 1.0) -> TrainerBackend:
    try:
        from astraflow.train.deepspeed_backend import DeepSpeedBackend
    except ImportError as e:
        raise RuntimeError(f"trainer backend 'deepspeed' needs a missing package ({e.name}); "
                           "install it with: pip install 'astraflow[deepspeed]'") from e
    return DeepSpeedBackend(model, tokenizer, cfg, temperature=temperature)


def build_backend(name: str, model: torch.nn.Module, tokenizer: Any, cfg: TrainerConfig, temperature: float = 1.0) -> TrainerBackend:
    """Instantiate the registered backend ``name``."""
    return BACKENDS.get(name)(model, tokenizer, cfg, temperature=temperature)
