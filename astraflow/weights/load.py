"""Loading a whole state into a module's own tensors, in place (the engine and the trainer keep their parameters, so
nothing that holds them, an optimizer or a compiled graph, goes stale).

On an accelerator, a source tensor in pinned (page-locked) host memory is copied without blocking: the copies of every
tensor are queued on the device's stream and run as DMA transfers while the host queues the next, and one wait at the
end makes the load whole before the call returns (the caller may change the source right after, and generation must
never see a half-loaded version). A source in pageable memory is copied the ordinary way, through the driver's staging
buffer, one blocking copy per tensor (``pinned_host``: where a node keeps its image pinned).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def on_accelerator(tensors: Mapping[str, object]) -> bool:
    """Whether any of ``tensors`` is a tensor on a CUDA device (where copies from pinned host memory run without
    blocking); a remote engine's view holds what it last sent, on the host."""
    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors.values())


def pinned_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` in pinned host memory (copied once; a tensor pinned already is kept as it is)."""
    return {name: t if t.is_pinned() else t.pin_memory() for name, t in tensors.items()}


@torch.no_grad()
def copy_weights(module: torch.nn.Module, state: Mapping[str, torch.Tensor], what: str = "weights") -> None:
    """Copy ``state`` into every tensor of ``module``'s state dict; ``ValueError`` naming ``what`` and the first tensors
    it lacks, before anything is copied. Pinned host tensors go to an accelerator without blocking, then one wait."""
    own = module.state_dict()
    missing = set(own) - set(state)
    if missing:
        raise ValueError(f"{what}: {len(missing)} tensors missing, among them {sorted(missing)[:3]}")
    queued: set[torch.device] = set()
    for name, tensor in own.items():
        source = state[name]
        overlap = tensor.device.type == "cuda" and source.device.type == "cpu" and source.is_pinned()
        tensor.copy_(source, non_blocking=overlap)
        if overlap:
            queued.add(tensor.device)
    for device in queued:  # the load is whole, and the source free to change, before returning
        torch.cuda.synchronize(device)
