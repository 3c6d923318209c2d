"""``deepspeed`` trainer backend: ZeRO 0-3, fp32 or bf16, data parallel over ranks.

One process on CPU (gloo, the tests) or N GPUs under the deepspeed launcher (NCCL)::

    deepspeed --num_gpus 8 -m astraflow.cli worker trainer --recipe ... --set trainer.backend=deepspeed

Every rank holds the whole batch (rank 0 pulls it from the plane and broadcasts it, see
``train/distributed.py``); rank r runs micro-batches r, r+W, r+2W, ..., padded with zero-weight
stand-ins to the same count on every rank (ZeRO-2/3 reduce gradients at every backward). Each
micro-batch loss is normalised over the whole batch and scaled by W, because DeepSpeed averages
gradients over the W ranks: the accumulated gradient is the full-batch gradient, as with the
torch backend.
Gradients accumulate with ``set_gradient_accumulation_boundary`` (the last micro-batch of a
step is the boundary) and ``backward(scale_wrt_gas=False)``, then one ``engine.step()``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

from astraflow.config import TrainerConfig
from astraflow.train.batching import Tensors
from astraflow.train.objective import SUMMED
from astraflow.train.torch_backend import TorchBackend
from astraflow.weights.delta import to_bf16_state

log = logging.getLogger(__name__)
TAG = "deepspeed"  # sub-directory of a checkpoint holding DeepSpeed's own files


def init_distributed() -> tuple[int, int]:
    """Join the launcher's process group, or make a one-process group (gloo on CPU, on a free port).

    The group meets in the launcher's store under a prefix of its life (``TORCHELASTIC_RESTART_COUNT``):
    torchrun's agent keeps one store across restarts, and a restarted rank must not read the addresses
    the dead group's ranks left there (gloo then connects to a dead peer and fails)."""
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:  # not under a launcher: a group of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        on_cpu = not torch.cuda.is_available()
        if on_cpu:  # DeepSpeed's shared-memory allreduce serves only its inference (inference_all_reduce): skip its C++ build (~30 s)
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        store, rank, world_size = next(rendezvous("env://"))
        life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group("gloo" if on_cpu else "nccl", store=PrefixStore(f"astraflow/life-{life}", store), rank=rank,
                                world_size=world_size)
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    return dist.get_rank(), dist.get_world_size()


class DeepSpeedBackend(TorchBackend):
    def __init__(self, model: torch.nn.Module, tokenizer: Any, cfg: TrainerConfig, temperature: float = 1.0) -> None:
        self.rank, self.world_size = init_distributed()
        super().__init__(model, tokenizer, cfg, temperature)

    def ds_config(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "train_micro_batch_size_per_gpu": 1,  # rows per micro-batch vary; the step is ours (see module doc)
            "gradient_accumulation_steps": 1,
            "gradient_clipping": c.max_grad_norm,
            "zero_optimization": {"stage": c.zero_stage},
            "bf16": {"enabled": c.precision == "bf16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }

    # ------------------------------------------------------------------ hooks
    def _device(self) -> torch.device:
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            return torch.device("cuda", local)
        return torch.device("cpu")

    def _wrap(self, module: torch.nn.Module) -> tuple[Any, Any]:
        trained = [p for p in module.parameters() if p.requires_grad]  # every one, or a LoRA model's adapters
        opt = torch.optim.AdamW(trained, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        engine, ds_opt, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=self.ds_config())
        self.engine = engine
        self.module = engine.module
        return engine, ds_opt

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # bf16 mode casts the module itself

    def _share(self, mbs: list[Tensors]) -> list[tuple[Tensors, float]]:
        """Micro-batches r, r+W, ...; then zero-weight stand-ins up to ceil(M / W): every rank runs as many backward
        passes, because ZeRO-2/3 reduce gradients at each one (unequal counts would pair unrelated collectives)."""
        W = self.world_size
        mine = [(mb, float(W)) for mb in mbs[self.rank :: W]]
        return mine + [(mbs[0], 0.0)] * (-(-len(mbs) // W) - len(mine))

    def _zero_grad(self) -> None:
        pass  # engine.step() clears the gradients

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def _optimizer_step(self, loss_finite: bool) -> tuple[float, bool]:
        if self.cfg.zero_stage == 0:  # no ZeRO optimizer to report it: measure before engine.step() clips
            norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), math.inf))
            if not (loss_finite and math.isfinite(norm)):  # no update: clear what was accumulated
                self.engine.zero_grad()
                return norm, False
            self.engine.step()
            return norm, True
        self.engine.step()  # ZeRO's optimizer checks the gradients itself and skips a step that overflowed
        reported = self.engine.get_global_grad_norm()
        return math.nan if reported is None else float(reported), not bool(getattr(self.engine.optimizer, "overflow", False))

    def _reduce(self, metrics: dict[str, float], weight: float) -> dict[str, float]:
        if self.world_size == 1:
            return metrics
        keys = sorted(metrics)
        sums = torch.tensor([metrics[k] if k in SUMMED else metrics[k] * weight for k in keys] + [weight], dtype=torch.float64)
        maxes = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        total = max(float(sums[-1]), 1e-12)
        return {k: float(maxes[i]) if k.endswith("_max") else float(sums[i]) if k in SUMMED else float(sums[i]) / total
                for i, k in enumerate(keys)}

    def _reduce_rows(self, gaps: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(gaps, op=dist.ReduceOp.MAX)  # a row runs on one rank; the others hold 0 for it
        return gaps

    # ------------------------------------------------------------------ state
    def _gathered(self, modifier_rank: int | None = None) -> contextlib.AbstractContextManager[Any]:
        if self.cfg.zero_stage == 3:
            return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=modifier_rank)
        return contextlib.nullcontext()

    def state_dict_bf16(self) -> dict[str, torch.Tensor]:
        with self._gathered():
            return to_bf16_state(self._published())

    def full_state(self) -> dict[str, torch.Tensor]:
        with self._gathered():
            return super().full_state()

    def base_bf16(self) -> dict[str, torch.Tensor] | None:
        with self._gathered():
            return super().base_bf16()

    @torch.no_grad()
    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        with self._gathered(modifier_rank=0):
            super().load_weights(state)
        refresh = getattr(self.engine.optimizer, "refresh_fp32_params", None)
        if refresh is not None:  # ZeRO / bf16 keep fp32 master copies apart from the module
            refresh()

    def save(self, path: Path) -> None:
        self.engine.save_checkpoint(str(path), tag=TAG, save_latest=False)
        weights = self.full_state()  # gathered on every rank under ZeRO-3
        if self.rank == 0:  # portable weights next to DeepSpeed's own files (tied tensors written once each)
            save_file(weights, str(path / "model.safetensors"))

    def snapshot(self) -> Callable[[Path], None] | None:
        return None  # DeepSpeed's save is collective over the ranks and reads the engine's live state: saved synchronously

    def load(self, path: Path) -> None:
        loaded, _ = self.engine.load_checkpoint(str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False)
        if loaded is None:
            raise RuntimeError(f"no DeepSpeed checkpoint under {path / TAG}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
