"""LoRA (``trainer.lora``): the policy trains low-rank adapters on the recipe's target modules, through ``peft``, with
the base weights frozen.

For each adapted linear layer, y = W₀x + (α/r)·B·A·x, with A (r × in) random and B (out × r) zero at the start, so
version 0 is the base model. Only A and B are trained (the optimizer holds their state alone); the losses are unchanged.

What a version announces (``trainer.lora.announce``):

* ``adapter`` (the default): the adapters alone (:func:`adapter_state`: ``m.lora_A`` and ``m.lora_B`` under the base
  model's name ``m`` of each adapted layer), against the base model's bf16 state digest (:func:`base_state`); nodes
  merge them into a copy of their base (weights/adapters.py). Every adapted matrix still changes at every step, but a
  version is the size of the adapters, not of the adapted matrices;
* ``merged``: the merged full weights, W = W₀ + (α/r)·B·A for every adapted layer, under the base model's own names
  (:func:`merged_state`), which every engine serves as it serves full fine-tuning.

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


def adapter_state(module: Any) -> dict[str, torch.Tensor]:
    """The adapters of an adapted model: ``m.lora_A`` (r × in) and ``m.lora_B`` (out × r) for each adapted layer ``m``
    (the base model's name)."""
    out: dict[str, torch.Tensor] = {}
    for name, layer in _layers(module).items():
        out[f"{name}.lora_A"] = layer.lora_A[ADAPTER].weight
        out[f"{name}.lora_B"] = layer.lora_B[ADAPTER].weight
    return out


def base_state(module: Any) -> dict[str, torch.Tensor]:
    """The frozen base weights of an adapted model, as the base model names them (what nodes must hold)."""
    return {name: t for name, t, _ in _base_tensors(module)}


def is_adapter_state(state: Mapping[str, torch.Tensor]) -> bool:
    return bool(state) and all(k.endswith((".lora_A", ".lora_B")) for k in state)


@torch.no_grad()
def load_adapters(module: Any, state: Mapping[str, torch.Tensor]) -> None:
    """``state`` (:func:`adapter_state`'s names, any float dtype) as the adapters; the base stays."""
    own = adapter_state(module)
    if set(own) != set(state):
        raise ValueError(f"adapters do not match the model's: {sorted(set(own) ^ set(state))[:3]}")
    for name, t in own.items():
        t.copy_(state[name])
