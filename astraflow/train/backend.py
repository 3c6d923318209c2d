"""The trainer-backend contract and the registry that picks one by ``trainer.backend``.

A backend owns the model being trained, its optimizer and how a step runs on the hardware.
The worker only sees this Protocol: it feeds batches, publishes ``state_dict_bf16()`` and
saves / loads checkpoints through it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from astraflow.config import TrainerConfig
    from astraflow.streams.trajectories import TrainingBatch


class TrainerBackend(Protocol):
    rank: int  # this process's rank (0 talks to the plane)
    world_size: int  # processes training together (data parallel)
    device: torch.device  # where it trains

    def step(self, batch: TrainingBatch) -> dict[str, float]:
        """One optimizer step on the whole batch (micro-batches accumulate); returns its metrics."""

    def state_dict_bf16(self) -> dict[str, torch.Tensor]:
        """The full weights as contiguous CPU bf16 tensors: what a weight version publishes.
        A collective call when the weights are sharded (every rank must call it)."""

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the trained weights (any float dtype), keeping the optimizer state."""

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


BACKENDS: dict[str, str] = {
    "torch": "astraflow.train.torch_backend:TorchBackend",
    "deepspeed": "astraflow.train.deepspeed_backend:DeepSpeedBackend",
}


def build_backend(name: str, model: torch.nn.Module, tokenizer: Any, cfg: TrainerConfig, temperature: float = 1.0) -> TrainerBackend:
    """Instantiate the registered backend ``name`` (imported lazily: deepspeed is an optional extra)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown trainer backend {name!r}; registered: {sorted(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(f"trainer backend {name!r} needs a missing package ({e.name}); "
                           f"install it with: pip install 'astraflow[{name}]'") from e
    return getattr(mod, cls)(model, tokenizer, cfg, temperature=temperature)
