"""``torch`` trainer backend: one process, CPU or GPU, fp32 or bf16 mixed precision.

A step splits the batch into micro-batches by token budget (``trainer.micro_batch_tokens``),
accumulates their gradients (each micro-batch loss normalised over the whole batch, so the
sum is the full-batch loss), clips the global gradient norm and takes one AdamW step, unless
the loss or the gradient norm is not finite: then no update is made (``skipped`` = 1).
bf16 keeps fp32 weights and optimizer state and runs the forward under bf16 autocast.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model

from astraflow.config import TrainerConfig
from astraflow.models import forward_takes
from astraflow.moe_routing import RoutingCounts, routed, routing_shape
from astraflow.streams.trajectories import TrainingBatch
from astraflow.train.batching import Tensors, first_predicting, micro_batches, to_tensors
from astraflow.train.experts import expert_params, hold_quiet_experts
from astraflow.train.lora import (
    adapter_state,
    base_state,
    is_adapted,
    is_adapter_state,
    load_adapters,
    load_merged,
    merged_state,
    with_lora,
)
from astraflow.train.losses.functional import gather_logprobs, token_entropy
from astraflow.train.objective import SUMMED, Objective, StepPlan, combine
from astraflow.train.tensor_files import read_state, write_safetensors, write_state
from astraflow.weights.delta import to_bf16_state
from astraflow.weights.load import copy_weights

OPTIMIZER_FILE = "optimizer.safetensors"  # its tensors, and its structure in the metadata (tensor_files.write_state)


def device_for(cfg: TrainerConfig) -> torch.device:
    """The device a backend trains on: ``trainer.device``, with ``auto`` = cuda when available."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return torch.device("cpu")


class TorchBackend:
    rank = 0
    world_size = 1

    def __init__(self, model: torch.nn.Module, tokenizer: Any, cfg: TrainerConfig, temperature: float = 1.0) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.device = self._device()
        if cfg.lora is not None and not is_adapted(model):  # adapters trained, the base frozen (train/lora.py)
            model = with_lora(model, cfg.lora)
        self.module = model.to(self.device)
        self.objective = Objective(cfg)
        self.suspects: dict[int, float] = {}  # the last step's rows the token check left out -> their logprob gap
        # π_ref: the version-0 weights, frozen (a resumed trainer loads them from its checkpoint)
        self.ref = _frozen_copy(self.module) if cfg.kl_coef > 0 else None
        self.model, self.opt = self._wrap(self.module)
        # trainer.unrouted_experts: hold: the experts no token was routed to sit the step out (train/experts.py)
        self.held_experts = expert_params(self.module) if cfg.unrouted_experts == "hold" else []
        self.routing_counts: RoutingCounts | None = None  # the last forward's, with recorded routing in the batch
        self.route_shape = routing_shape(self.module) if cfg.routing != "own" else None  # (layers, k, experts) it routes
        self.keeps_logits = forward_takes(self.module, "logits_to_keep")  # transformers 4.50 on

    # ------------------------------------------------------------------ hooks for subclasses
    def _device(self) -> torch.device:
        return device_for(self.cfg)

    def _wrap(self, module: torch.nn.Module) -> tuple[Any, Any]:
        """(callable model for the forward pass, optimizer)."""
        trained = [p for p in module.parameters() if p.requires_grad]  # every one, or a LoRA model's adapters
        return module, adamw(trained, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        fp32_weights = next(self.module.parameters()).dtype == torch.float32
        if self.cfg.precision == "bf16" and fp32_weights:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _share(self, mbs: list[Tensors]) -> list[tuple[Tensors, float]]:
        """The micro-batches this process runs, each with its loss scale (data parallel splits them)."""
        return [(mb, 1.0) for mb in mbs]

    def _zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def _optimizer_step(self, loss_finite: bool) -> tuple[float, bool]:
        """Clip, step, clear; returns the global gradient norm before clipping and whether the step was
        taken: not when the loss or the norm is non-finite (the weights stay as they were)."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.max_grad_norm))
        stepped = loss_finite and math.isfinite(grad_norm)
        if stepped:
            with hold_quiet_experts(self.opt, self.held_experts):
                self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return grad_norm, stepped

    def _reduce(self, metrics: dict[str, float], weight: float) -> dict[str, float]:
        """Metrics of this process's micro-batches (``weight`` counted tokens) -> the whole batch's."""
        return metrics

    def _reduce_rows(self, gaps: torch.Tensor) -> torch.Tensor:
        """(B,) per-row values of this process's micro-batches (0 for rows it did not run) -> the whole batch's (max)."""
        return gaps

    # ------------------------------------------------------------------ the step
    def _logprobs(self, model: Any, mb: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π(y_t|s_t) (b, t) float32, completion logits (b, t, V) / temperature). With the routing the nodes
        recorded (``trainer.routing``), the forward takes it (``replayed``) and counts where its own differs. Logits
        are computed from the first position that predicts a completion token on (``logits_to_keep``): a prompt's
        others would cost the output layer, forward and backward, and (b, l, V) floats of memory, for nothing."""
        first = first_predicting(mb) if self.keeps_logits else 0  # the positions before it predict nothing trained
        keep = {"logits_to_keep": mb.input_ids.shape[1] - first} if first else {}
        with self._autocast(), routed(model, mb.routing, self.cfg.routing == "replayed") as counts:
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False, **keep).logits  # (b, l − first, V)
        self.routing_counts = counts
        rows = torch.arange(logits.shape[0], device=logits.device)[:, None]  # (b, 1)
        comp_logits = logits[rows, (mb.logit_index - first).clamp(min=0)] / self.temperature  # (b, t, V); padding: masked
        return gather_logprobs(comp_logits, mb.targets), comp_logits

    @torch.no_grad()
    def _full_logprobs(self, x: Tensors, mbs: list[Tensors]) -> torch.Tensor:
        """log π_θ (B, T) of the whole batch, micro-batch by micro-batch, without gradients."""
        full = torch.zeros_like(x.behave_logprobs)  # (B, T)
        for mb in mbs:
            lp, _ = self._logprobs(self.model, mb)
            full[mb.rows, : lp.shape[1]] = lp
        return full

    def step(self, batch: TrainingBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        self.module.train()
        x = to_tensors(batch, self.tokenizer.pad_token_id, routing=self.route_shape).to(self.device)
        mbs = micro_batches(x, self.cfg.micro_batch_tokens)
        mine = self._share(mbs)
        plan: StepPlan | None = None
        if not self.objective.needs_logprobs_first:
            plan = self.objective.plan(x)
        elif len(mbs) > 1 or self.world_size > 1:  # M2PO: the mask is a statistic of the whole batch
            plan = self.objective.plan(x, self._full_logprobs(x, mbs))
        self._zero_grad()
        parts: list[tuple[dict[str, float], float]] = []
        gaps = torch.zeros(x.rewards.shape[0], device=x.rewards.device)  # (B,) of the rows the token check leaves out
        for i, (mb, scale) in enumerate(mine):
            logprobs, comp_logits = self._logprobs(self.model, mb)  # (b, t), (b, t, V)
            counts = self.routing_counts
            if plan is None:  # a single micro-batch is the whole batch
                full = torch.zeros_like(x.behave_logprobs)
                full[mb.rows, : logprobs.shape[1]] = logprobs.detach()
                plan = self.objective.plan(x, full)
            ref = self._ref_logprobs(mb) if self.ref is not None else None
            out = self.objective.loss(mb, logprobs, plan, ref)
            self._backward(out.loss * scale, last=i == len(mine) - 1)
            with torch.no_grad():
                m = mb.mask
                entropy = float((token_entropy(comp_logits.detach()) * m).sum() / m.sum().clamp(min=1))
            mets = {**out.metrics, "entropy": entropy}
            if counts is not None:  # the share of recorded (position, layer) routes this forward chose otherwise
                mets["routing_mismatch"] = counts.share()
            if not scale:  # a stand-in that only joins the gradient reduction: counts for nothing
                mets = {k: 0.0 if k in SUMMED else v for k, v in mets.items()}
            elif out.gaps is not None:
                gaps[mb.rows.to(gaps.device)] = out.gaps.to(gaps.device)
            parts.append((mets, float(mb.mask.sum()) if scale else 0.0))
        metrics = self._reduce(combine(parts), sum(w for _, w in parts))  # every rank sees the same loss: they skip together
        gaps = self._reduce_rows(gaps)
        self.suspects = {int(i): float(gaps[i]) for i in gaps.nonzero().flatten().tolist()}
        grad_norm, stepped = self._optimizer_step(math.isfinite(metrics["loss"]))
        dt = time.perf_counter() - t0
        if self.cfg.routing != "own":  # what recording it costs on the wire
            metrics["routing_bytes"] = sum(len(t.routing) for t in batch.trajectories) / max(len(batch.trajectories), 1)
        return {**metrics, "grad_norm": grad_norm, "reward_mean": float(x.rewards.mean()), "tokens": float(x.n_tokens),
                "tokens_per_s": x.n_tokens / dt, "step_s": dt, "micro_batches": float(len(mbs)), "skipped": float(not stepped)}

    @torch.no_grad()
    def _ref_logprobs(self, mb: Tensors) -> torch.Tensor:
        lp, _ = self._logprobs(self.ref, mb)
        return lp

    # ------------------------------------------------------------------ state
    def _weights(self) -> Mapping[str, torch.Tensor]:
        """The policy's weights as the model names them (a LoRA model's merged: train/lora.py)."""
        return merged_state(self.module) if is_adapted(self.module) else self.module.state_dict()

    def _published(self) -> Mapping[str, torch.Tensor]:
        """What a version announces: the weights, or a LoRA model's adapters alone (``trainer.lora.announce: adapter``)."""
        return adapter_state(self.module) if self.announces_adapters else self._weights()

    @property
    def announces_adapters(self) -> bool:
        return self.cfg.lora is not None and self.cfg.lora.announce == "adapter" and is_adapted(self.module)

    def state_dict_bf16(self) -> dict[str, torch.Tensor]:
        return to_bf16_state(self._published())

    def base_bf16(self) -> dict[str, torch.Tensor] | None:
        return to_bf16_state(base_state(self.module)) if self.announces_adapters else None

    def full_state(self) -> dict[str, torch.Tensor]:
        """Float32 CPU copies of the module's weights (gathered when sharded; for tests and benchmarks)."""
        return {k: v.detach().float().cpu().clone() for k, v in self._weights().items()}

    @torch.no_grad()
    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        if is_adapted(self.module):
            return load_adapters(self.module, state) if is_adapter_state(state) else load_merged(self.module, state)
        copy_weights(self.module, state)

    def reference_state(self) -> dict[str, torch.Tensor] | None:
        return None if self.ref is None else {k: v.detach().cpu().clone() for k, v in self.ref.state_dict().items()}

    def load_reference(self, state: Mapping[str, torch.Tensor]) -> None:
        if self.ref is not None:
            copy_weights(self.ref, state, "the reference weights")

    def save(self, path: Path) -> None:
        self._copied()(path)

    def snapshot(self) -> Callable[[Path], None] | None:
        return self._copied()

    def _copied(self) -> Callable[[Path], None]:
        """CPU copies of the weights (tied tensors once, as ``save_model`` writes them) and of the optimizer state, and
        what writes them under a directory, with the GIL released for their bytes (``train/tensor_files.py``)."""
        weights, aliases = _untied_copy(self.module.state_dict())
        optimizer = _cpu_copy(self.opt.state_dict())

        def write(path: Path) -> None:
            write_safetensors(weights, path / "model.safetensors", metadata=aliases or None)
            write_state(optimizer, path / OPTIMIZER_FILE)

        return write

    def load(self, path: Path) -> None:
        load_model(self.module, str(path / "model.safetensors"), strict=True, device=str(self.device))
        if (path / OPTIMIZER_FILE).exists():
            self.opt.load_state_dict(read_state(path / OPTIMIZER_FILE, self.device))
        else:  # a checkpoint written before the optimizer state was a safetensors file
            self.opt.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True))

    def retune(self) -> dict[str, tuple[float, float]]:
        return retune_optimizer(self.opt, self.cfg)


def retune_optimizer(opt: torch.optim.Optimizer, cfg: TrainerConfig) -> dict[str, tuple[float, float]]:
    """Set the recipe's learning rate and weight decay on every parameter group of ``opt`` (a checkpoint restored its
    own); what changed, as (was, now)."""
    changed: dict[str, tuple[float, float]] = {}
    for key, value in (("lr", cfg.lr), ("weight_decay", cfg.weight_decay)):
        was = [float(g[key]) for g in opt.param_groups]
        for g in opt.param_groups:
            g[key] = value
        if any(w != value for w in was):
            changed[key] = (was[0], value)
    return changed


def _untied_copy(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Contiguous CPU copies of ``state``, a tensor sharing another's storage (tied weights) left out and named in the
    metadata as an alias of the one kept (``load_model`` resolves it, as for a file ``save_model`` wrote)."""
    kept: dict[tuple[int, int, tuple[int, ...]], str] = {}
    weights: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
        if key in kept:
            aliases[name] = kept[key]
            continue
        kept[key] = name
        weights[name] = t.detach().to("cpu", copy=True).contiguous()
    return weights, aliases


def _cpu_copy(obj: Any) -> Any:
    """``obj`` (an optimizer state dict: nested dicts and lists of tensors and numbers) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def _frozen_copy(module: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(module).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused where torch has the kernel for the parameters' device (CPU, CUDA): one pass over every tensor instead
    of a loop of small ops (a 1 M-parameter model on a CPU core: 0.75 against 3.4 ms a step). A checkpoint keeps the
    choice: loading one restores its optimizer's ``fused`` flag with its state, so a resumed run steps as it did."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except RuntimeError:  # no fused kernel for this device or dtype
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
