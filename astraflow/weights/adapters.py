"""A LoRA version on a node (``trainer.lora.announce: adapter``): its state is adapters, served merged into a copy of the
base model.

A LoRA version's state holds, for each adapted linear layer ``m``, ``m.lora_A`` (r x in) and ``m.lora_B`` (out x r);
the layer serves W = W0 + s * B A (s = alpha / rank, the announcement's ``adapter.scale``), W0 being the base model's
``m.weight``. The version's digests and deltas are those of that state, so the weight plane carries the adapters alone.

Served merged into a copy: the node keeps W0 of every layer it ever adapted (in the engine's dtype) and writes W into the
engine's own weight per version, under the engine's lock (``sync.install``). Generation runs the plain model, the
decoding path of full fine-tuning: peft's unmerged serving would add two thin matmuls per adapted layer to every decoded
token, and merging in place (W += s B A, then W -= it at the next version) drifts in bf16 where a copy never does. A
version costs one rank-r product per adapted layer.

The base is the model the version names by digest (``adapter.base_digest``):

* the node's own model (the recipe's, or ``model.pretrained``), when its bf16 state digest is that digest: nothing is
  fetched (the pretrained case: gigabytes nodes load from their own disk);
* else the base the version names in the object store (``adapter.base``: the trainer stores it when a warm start trained
  every weight), fetched once, checked against the digest, and written into the engine with the next version;
* else the version is refused with the reason (:class:`BaseMismatch`, ``base_mismatch``): the engine keeps what it serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from astraflow.streams.messages import AdapterSpec
from astraflow.weights.delta import state_digest, to_bf16_state

A, B = ".lora_A", ".lora_B"


class BaseMismatch(RuntimeError):
    """A LoRA version over a base the node does not hold and cannot fetch."""


class AdapterError(ValueError):
    """A LoRA state that does not fit its base (names, shapes)."""


def adapted_layers(adapters: Mapping[str, torch.Tensor]) -> list[str]:
    """The layers a LoRA state adapts (each with its A and B), sorted; AdapterError when a name is not one of a pair."""
    layers = {n.removesuffix(A) for n in adapters if n.endswith(A)}
    expected = {m + s for m in layers for s in (A, B)}
    if set(adapters) != expected:
        stray = sorted(set(adapters) ^ expected)
        raise AdapterError(f"{len(stray)} adapter tensors without their pair or not named m.lora_A / m.lora_B: {stray[:3]}")
    return sorted(layers)


def merged_weight(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W = W0 + s * B A, computed in fp32 (AdapterError when the shapes do not fit: A r x in, B out x r, W0 out x in)."""
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w0.shape):
        raise AdapterError(f"A {tuple(a.shape)} and B {tuple(b.shape)} do not adapt a {tuple(w0.shape)} weight")
    return w0.float() + scale * (b.float() @ a.float())


class MergedAdapters:
    """Serves a policy's LoRA versions on one engine, merged into a copy of the base (module doc)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.digest: str | None = None  # of the base the engine's unadapted weights are
        self.kept: dict[str, torch.Tensor] = {}  # W0 of each layer ever adapted ("m.weight"), in the engine's dtype
        self.served: set[str] = set()  # layers whose merged weight the engine holds
        self.pending: dict[str, torch.Tensor] | None = None  # a fetched base, written into the engine with the next version
        self.pending_digest: str | None = None

    def own_digest(self) -> str:
        """The digest of the base the engine holds: before any version was loaded, the node's own model."""
        if self.digest is None:
            if self.engine.version >= 0:
                raise BaseMismatch(f"the engine serves v{self.engine.version} of full weights: it holds no base model any more")
            view = self.engine.state_view()
            if not view:
                raise BaseMismatch(f"engine {type(self.engine).__name__} holds no weights of its own to serve adapters on; "
                                   "announce merged weights (trainer.lora.announce: merged)")
            self.digest = state_digest(to_bf16_state(view))
        return self.digest

    def needs_base(self, spec: AdapterSpec) -> bool:
        """Whether ``spec``'s base must be fetched; BaseMismatch when the engine does not hold it and the version names
        none to fetch."""
        if spec.base_digest == self.pending_digest:
            return False
        try:
            own, why = self.own_digest(), ""
        except BaseMismatch as e:
            own, why = None, str(e)
        if own == spec.base_digest:
            return False
        if spec.base is not None:
            return True
        raise BaseMismatch(why or f"adapters over base {spec.base_digest[:12]}, and this node's model is {str(own)[:12]}; the "
                           "version names no base to fetch: does this node build the trainer's model (model.pretrained, "
                           "model.seed)?")

    def take_base(self, base: dict[str, torch.Tensor], digest: str, spec: AdapterSpec) -> None:
        """``base`` (fetched, ``digest`` its state digest) as the base of the versions to come; BaseMismatch when it is not
        ``spec``'s."""
        if digest != spec.base_digest:
            raise BaseMismatch(f"the base fetched for the adapters hashes to {digest[:12]}, not {spec.base_digest[:12]}")
        self.pending, self.pending_digest = base, digest

    def merged(self, adapters: Mapping[str, torch.Tensor], scale: float) -> tuple[dict[str, torch.Tensor], bool]:
        """What to write into the engine for ``adapters``, and whether it is a whole state: a fetched base goes in whole with
        every adapted layer's W; else every adapted layer's W, and W0 back in the layers adapted no more."""
        layers = adapted_layers(adapters)
        whole = self.pending is not None
        if self.pending is not None:
            self.kept, source = {}, self.pending
        else:
            source = dict(self.engine.state_view())
        for m in layers:
            name = m + ".weight"
            if name not in source:
                raise AdapterError(f"adapters for {m}, a layer the base model does not have")
            if name not in self.kept:  # never written into the engine yet: it is W0
                self.kept[name] = source[name].detach().clone()
        out = {m + ".weight": merged_weight(self.kept[m + ".weight"], adapters[m + A], adapters[m + B], scale) for m in layers}
        if self.pending is not None:
            return {**self.pending, **out}, whole
        for m in self.served - set(layers):
            out[m + ".weight"] = self.kept[m + ".weight"]
        return out, whole

    def installed(self, adapters: Mapping[str, torch.Tensor]) -> None:
        """The engine serves ``adapters`` now (merged): a fetched base is its base from here on."""
        self.served = set(adapted_layers(adapters))
        if self.pending is not None:
            self.digest, self.pending, self.pending_digest = self.pending_digest, None, None
