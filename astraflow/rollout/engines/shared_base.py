"""Several policies on one base model (``rollout.shared_base``): a node holds the base once, with each policy's LoRA
adapter beside it, instead of one merged model per policy.

The base model is wrapped by ``peft`` with one adapter per policy (named after it; rank, alpha and target modules from
the policy's ``trainer.lora``). Each policy's handle gets an :class:`AdapterEngine`, an ``Engine`` whose requests name
the adapter: the one ``hf`` engine generates them, requests of different policies in one batch (peft's mixed-adapter
batches), each token under the version of its own policy's adapter. A version of a policy writes its announced
adapters into that policy's adapter (``load_adapter``, holding the engine as a load does); the base is never written.

Served unmerged: every decoded token pays two thin matmuls per adapted layer and policy present in the batch (the
price of holding one base for all; a policy alone is served cheaper merged into a copy: weights/adapters.py). Every
policy must announce adapters over this node's base (WeightSync asks ``adapter_problem`` before it fetches a version);
a version over another base is refused, since the base is every policy's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from astraflow.config import LoraConfig, Recipe
from astraflow.rollout.engines.base import Completion, GenerationRequest
from astraflow.rollout.engines.hf import HFEngine
from astraflow.streams.messages import AdapterSpec
from astraflow.weights.adapters import A, AdapterError, B, BaseMismatch, adapted_layers
from astraflow.weights.delta import state_digest, to_bf16_state


class SharedBase:
    """One ``hf`` engine over a base model carrying one LoRA adapter per policy (``loras``: each policy's)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, loras: Mapping[str, LoraConfig], **engine_options: Any) -> None:
        try:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model
            from peft.tuners.lora import LoraLayer
        except ImportError as e:
            raise RuntimeError(f"rollout.shared_base needs a missing package ({e.name}); pip install 'astraflow[lora]'") from e
        if not loras:
            raise ValueError("rollout.shared_base: no policy trains adapters")
        self.base_digest = state_digest(to_bf16_state(model.state_dict()))  # before any adapter is added
        wrapped: Any = None
        for name, cfg in loras.items():
            peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, target_modules=list(cfg.target_modules),
                                      bias="none")
            if wrapped is None:
                wrapped = get_peft_model(model, peft_cfg, adapter_name=name)
            else:
                wrapped.add_adapter(name, peft_cfg)
        self.engine = HFEngine(wrapped, tokenizer, **engine_options)
        self.layers: dict[str, dict[str, Any]] = {}  # policy -> its adapted layers (the base model's names) -> peft layer
        for module_name, module in wrapped.get_base_model().named_modules():
            if isinstance(module, LoraLayer):
                for policy in module.lora_A:
                    self.layers.setdefault(policy, {})[module_name] = module
        self.scales = {p: cfg.alpha / cfg.rank for p, cfg in loras.items()}

    @classmethod
    def build(cls, recipe: Recipe) -> SharedBase:
        """The recipe's model (every policy's: the recipe checks they are one) with each policy's adapter, on cuda when
        available, in the ``hf`` engine's dtype."""
        from astraflow.models import build_model, load_tokenizer

        model_cfg = recipe.policies[recipe.primary].model
        tokenizer = load_tokenizer(model_cfg.tokenizer)
        model = build_model(model_cfg, tokenizer)
        options = recipe.rollout.engine
        dtype = getattr(options, "dtype", "model")
        if dtype != "model":
            model = model.to(getattr(torch, dtype))
        loras = {p: c.trainer.lora for p, c in recipe.policies.items() if c.trainer.lora is not None}
        return cls(model, tokenizer, loras, device="cuda" if torch.cuda.is_available() else "cpu",
                   gather=getattr(options, "gather", 0.5), partial_rollouts=recipe.rollout.partial_rollouts)

    def view(self, policy: str) -> AdapterEngine:
        return AdapterEngine(self, policy)

    def base_problem(self, policy: str, spec: AdapterSpec) -> str | None:
        """Why this node cannot serve ``spec`` as ``policy``'s adapters, or None."""
        if spec.base_digest != self.base_digest:
            return (f"adapters over base {spec.base_digest[:12]}, and this node serves every policy's adapters on base "
                    f"{self.base_digest[:12]} (rollout.shared_base): every policy's trainer must start from that base")
        if abs(spec.scale - self.scales[policy]) > 1e-9 * self.scales[policy]:
            return f"adapters of scale {spec.scale:g}, and {policy}'s adapter here is {self.scales[policy]:g} (trainer.lora alpha / rank)"
        return None

    @torch.no_grad()
    def load(self, policy: str, adapters: Mapping[str, torch.Tensor], version: int, spec: AdapterSpec) -> None:
        problem = self.base_problem(policy, spec)
        if problem is not None:
            raise BaseMismatch(problem)
        layers = self.layers[policy]
        named = adapted_layers(adapters)
        if set(named) != set(layers):
            raise AdapterError(f"{policy}: adapters for {sorted(set(named) ^ set(layers))[:3]}, not this node's adapted layers")
        for m in named:
            for suffix, weights in ((A, layers[m].lora_A), (B, layers[m].lora_B)):
                if tuple(adapters[m + suffix].shape) != tuple(weights[policy].weight.shape):
                    raise AdapterError(f"{policy}: {m}{suffix} is {tuple(adapters[m + suffix].shape)}, this node's "
                                       f"{tuple(weights[policy].weight.shape)} (trainer.lora rank)")

        def write() -> None:
            for m in named:
                layers[m].lora_A[policy].weight.copy_(adapters[m + A])
                layers[m].lora_B[policy].weight.copy_(adapters[m + B])

        self.engine.update(write, version, adapter=policy)


class AdapterEngine:
    """The ``Engine`` of one policy on a :class:`SharedBase`: its requests name its adapter."""

    def __init__(self, shared: SharedBase, policy: str) -> None:
        self.shared, self.policy = shared, policy

    @property
    def version(self) -> int:
        return self.shared.engine.adapter_versions.get(self.policy, -1)

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        return self.shared.engine.generate([replace(r, adapter=self.policy) for r in requests])

    def adapter_problem(self, spec: AdapterSpec) -> str | None:
        """Why a version of ``spec`` cannot be served here (WeightSync asks before it fetches the version), or None."""
        return self.shared.base_problem(self.policy, spec)

    def load_adapter(self, adapters: Mapping[str, torch.Tensor], version: int, spec: AdapterSpec) -> None:
        self.shared.load(self.policy, adapters, version, spec)

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        raise ValueError(f"{self.policy}: full weights announced, and this node serves adapters on a shared base "
                         "(rollout.shared_base): the policy must train LoRA announcing adapters")

    def state_view(self) -> Mapping[str, torch.Tensor]:
        return {}  # the base is every policy's: nothing of it is this policy's to merge into

    def expect_callers(self, n: int) -> None:
        self.shared.engine.expect_callers(n)  # a node's slots call every policy: the same threads

    def close(self) -> None:
        """The shared engine is freed with the node."""
