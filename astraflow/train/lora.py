"""LoRA (``trainer.lora``): the policy trains low-rank adapters on the recipe's target modules, through ``peft``, with
the base weights frozen.

For each adapted linear layer, y = W₀x + (α/r)·B·A·x, with A (r × in) random and B (out × r) zero at the start, so
version 0 is the base model. Only A and B are trained (the optimizer holds their state alone); the losses are unchanged.

A version is announced as the merged full weights, W = W₀ + (α/r)·B·A for every adapted layer, under the base model's
own names (:func:`merged_state`): every node, engine and the weight plane serve it as they serve full fine-tuning, and
the state digest is that of what nodes run. Its delta is that of the merged weights: every adapted matrix changes at
every step (announcing the adapter alone, against the base model's digest, is not built).

Checkpoints hold the whole adapted model (base, adapters) and the adapters' optimizer state, so a resume is exact.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from astraflow.config import LoraConfig

ADAPTER = "default"  # peft's name for the one adapter


def with_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` with an adapter on each of ``cfg.target_modules``, every other weight frozen (a ``peft`` model)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as e:
        raise RuntimeError(f"trainer.lora needs a missing package ({e.name}); install it with: pip install 'astraflow[lora]'") from e
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
                              bias="none")
    adapted = get_peft_model(model, peft_cfg)
    if not any(p.requires_grad for p in adapted.parameters()):
        raise ValueError(f"trainer.lora.target_modules {cfg.target_modules} names no linear layer of the model")
    return adapted


def is_adapted(module: torch.nn.Module) -> bool:
    return hasattr(module, "get_base_model") and hasattr(module, "peft_config")


def _layers(module: Any) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    base = module.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def _base_tensors(module: Any) -> Iterator[tuple[str, torch.Tensor, str | None]]:
    """Each tensor of an adapted model but the adapters': (the name the base model gives it, the tensor, the adapted
    layer it is the weight of, or None)."""
    for key, t in module.get_base_model().state_dict().items():
        if ".lora_" in key:
            continue
        owner, sep, leaf = key.rpartition(".base_layer.")
        yield (f"{owner}.{leaf}" if sep else key), t, (owner if sep and leaf == "weight" else None)


@torch.no_grad()
def merged_state(module: Any) -> dict[str, torch.Tensor]:
    """The full weights of an adapted model as the base model names them: W₀ + (α/r)·B·A for each adapted layer's
    weight, every other tensor as it is (tied tensors stay tied)."""
    layers = _layers(module)
    return {name: t if layer is None else t + layers[layer].get_delta_weight(ADAPTER).to(t.dtype)
            for name, t, layer in _base_tensors(module)}


@torch.no_grad()
def load_merged(module: Any, state: Mapping[str, torch.Tensor]) -> None:
    """``state`` (full weights, the base model's names) as the base weights, every adapter's B zeroed: the merged
    weights are then ``state`` exactly (the approximate resume: the announced weights under the adapters' optimizer)."""
    for name, t, _ in _base_tensors(module):
        t.copy_(state[name])
    for layer in _layers(module).values():
        layer.lora_B[ADAPTER].weight.zero_()
