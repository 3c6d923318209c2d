"""The pipeline on one GPU: hf engine, torch trainer in bf16, weights through a real nats-server.

After a short SFT warm start (so that groups hold mixed rewards and steps move the weights), each
iteration is what the roles do, in one process: the ``single_turn`` workflow generates groups
of arithmetic answers with the ``hf`` engine and scores them with the ``arithmetic`` verifier; the
groups get GRPO advantages and become a batch; the ``torch`` trainer takes one step (bf16 mixed
precision on CUDA); the ``WeightPublisher`` announces the new version (bf16 delta, object store of
an embedded nats-server); the engine's ``WeightSync`` fetches it and applies it in place. Every
version, the engine's bf16 weights must hash to the trainer's.

Last stdout line, JSON: generation tokens/s, train step seconds and tokens/s, publish and apply
seconds (median over the iterations after the first), delta and keyframe bytes, ``digests_ok``.
The apply is split into its last stage, the install into the engine's parameters (``install_s``), and
the rest (fetch, decode, add into the node's host image, state digest); ``apply_over_step`` is a
version's apply over its train step (goal: under 0.1). On CUDA the node keeps its image in pinned host
memory and installs with non-blocking copies (``weights/load.py``); ``image_pinned`` says it did, and
``install_whole_pageable_s`` / ``install_whole_pinned_s`` time one whole-state install from pageable
and from pinned host memory side by side (medians of 5).

    python examples/gpu_pipeline_check.py                        # cuda, bf16, a ~150M-parameter Qwen2
    python examples/gpu_pipeline_check.py --arch qwen3_moe       # the same width as Mixture-of-Experts
    python examples/gpu_pipeline_check.py --device cpu --tiny    # smoke test (tests/test_gpu_pipeline_check.py)

A lent GPU machine has torch with CUDA but none of our other packages and no network. Build the
wheels here and carry them (``wheels/``, git-ignored, < 64 MiB), then run ``examples/gpu_check.sh``
there, which installs them offline and runs this script; see that file for the commands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from astraflow.algorithms.advantages.grpo import Grpo
from astraflow.algorithms.types import Group
from astraflow.config import ModelConfig, SFTConfig, TrainerConfig, parse_recipe
from astraflow.dataflow.groups import to_sample
from astraflow.models import build_model, load_tokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.hf import HFEngine
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.registry import get_workflow
from astraflow.streams.messages import Batch, Task, Trajectory, TrajRef
from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.server import EmbeddedServer
from astraflow.streams.trajectories import TrainingBatch
from astraflow.tasks import load_split
from astraflow.train.sft import sft
from astraflow.train.torch_backend import TorchBackend
from astraflow.weights.delta import state_digest, to_bf16_state
from astraflow.weights.load import copy_weights, pinned_host
from astraflow.weights.publish import WeightPublisher
from astraflow.weights.sync import WeightSync

GPU_MODEL = {"hidden_size": 1024, "intermediate_size": 2816, "num_layers": 12, "num_heads": 16, "num_kv_heads": 4, "max_positions": 256}
TINY_MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "max_positions": 64}
MOE = {"arch": "qwen3_moe", "num_experts": 8, "experts_per_token": 2}


def tasks_for(problems: list[Any], start: int, n: int, group_size: int) -> list[Task]:
    return [Task(task_id=f"t{start + i}", workflow="single_turn", policy="solver", prompt_id=f"p{(start + i) % len(problems)}",
                 prompt=p.prompt, group_size=group_size, meta=p.meta)
            for i, p in enumerate(problems[(start + k) % len(problems)] for k in range(n))]


def batch_of(trajectories: list[Trajectory], version: int) -> TrainingBatch:
    """GRPO advantages per task group, as the dataflow computes them; the manifest's references number the
    trajectories in order (here they are handed to the trainer in process, not read from the TRAJ stream)."""
    by_task: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_task.setdefault(t.task_id, []).append(t)
    grpo, ordered, advantages = Grpo(), [], []
    for task_id, group in by_task.items():
        samples = tuple(to_sample(t) for t in group)
        advantages += grpo.compute(Group(task_id=task_id, prompt_id=group[0].prompt_id, policy="solver", samples=samples))
        ordered += group
    refs = [TrajRef(seq=k + 1, traj_id=t.traj_id, task_id=t.task_id) for k, t in enumerate(ordered)]
    manifest = Batch(batch_id=f"check-{version:06d}", policy="solver", refs=refs, task_ids=list(by_task),
                     advantages=np.asarray(advantages, "<f4").tobytes())
    return TrainingBatch(manifest, ordered)


async def check(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU (torch.cuda.is_available() is False)")
    shape = {**(TINY_MODEL if args.tiny else GPU_MODEL), **(MOE if args.arch == "qwen3_moe" else {})}
    mcfg = ModelConfig(**shape)
    tok = load_tokenizer(mcfg.tokenizer)
    tcfg = TrainerConfig(device=args.device, precision="bf16" if cuda else "fp32", lr=args.lr, micro_batch_tokens=args.micro_batch_tokens)
    train, _ = load_split(parse_recipe({"name": "check"}).data)
    engine = HFEngine(build_model(mcfg.model_copy(update={"dtype": "bfloat16" if cuda else "float32"}), tok), tok, device=args.device)
    backend = TorchBackend(build_model(mcfg, tok), tok, tcfg)  # fp32 weights and AdamW state, bf16 autocast on CUDA
    params = sum(p.numel() for p in backend.module.parameters())
    sft_loss = sft(backend.module, tok, train, SFTConfig(steps=args.sft_steps, lr=args.sft_lr), seed=0) if args.sft_steps else None
    handle = PolicyHandle(engine, tok, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0), name="solver")
    workflow = get_workflow("single_turn", get_reward("arithmetic"))
    rows: list[dict[str, float]] = []
    digests_ok = True
    installs: list[float] = []  # seconds of each install into the engine's parameters (the apply's last stage)
    engine_load = engine.load_state

    def timed_load(state: Any, version: int) -> None:
        t0 = time.perf_counter()
        engine_load(state, version)
        installs.append(time.perf_counter() - t0)

    engine.load_state = timed_load  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as d:
        server = EmbeddedServer(Path(d)).start()
        plane = await Plane.connect(NatsOptions(url=server.url), "gpucheck", "check")
        try:
            await plane.ensure_topology(Topology(policies=("solver",)))
            publisher = WeightPublisher(plane, "solver", keyframe_every=args.steps + 1)
            sync = WeightSync(plane, "solver", engine)
            keyframe = await publisher.publish(backend.state_dict_bf16(), 0)
            t0 = time.perf_counter()
            await sync.goto(0)
            keyframe_apply_s = time.perf_counter() - t0
            for v in range(1, args.steps + 1):
                tasks = tasks_for(train, v * args.tasks, args.tasks, args.group_size)
                _sync(cuda)
                t0 = time.perf_counter()
                trajectories = workflow.run(tasks, {"solver": handle}, "gpu-check")
                _sync(cuda)
                gen_s = time.perf_counter() - t0
                gen_tokens = sum(len(t.completion()) for t in trajectories)
                step = backend.step(batch_of(trajectories, v))
                state = backend.state_dict_bf16()
                t0 = time.perf_counter()
                ann = await publisher.publish(state, v, [f"check-{v:06d}"], step)
                publish_s = time.perf_counter() - t0
                installed = len(installs)
                t0 = time.perf_counter()
                await sync.goto(v)
                _sync(cuda)
                apply_s = time.perf_counter() - t0
                install_s = sum(installs[installed:])
                digests_ok &= state_digest(state) == ann.state_digest == state_digest(to_bf16_state(engine.state_view()))
                rows.append({"gen_tokens_per_s": gen_tokens / gen_s, "gen_s": gen_s, "step_s": step["step_s"],
                             "train_tokens_per_s": step["tokens_per_s"], "publish_s": publish_s, "apply_s": apply_s,
                             "install_s": install_s, "apply_over_step": apply_s / step["step_s"],
                             "delta_bytes": float(sum(o.size for o in ann.objects)), "reward_mean": step["reward_mean"]})
            image_pinned = sync.held.pinned and all(t.is_pinned() for t in (sync.held.image or {}).values())
        finally:
            await plane.close()
            server.stop()
    whole = whole_installs(engine, cuda)
    timed = rows[1:] or rows  # the first iteration warms up kernels and allocators
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in timed), 4) for k in timed[0]}
    out.update(
        device=torch.cuda.get_device_name() if cuda else "cpu",
        arch=mcfg.arch,
        params=params,
        steps=args.steps,
        sequences_per_step=args.tasks * args.group_size,
        max_new_tokens=args.max_new_tokens,
        keyframe_bytes=sum(o.size for o in keyframe.objects),
        keyframe_apply_s=round(keyframe_apply_s, 4),
        sft_steps=args.sft_steps,
        sft_loss=sft_loss,
        trainer_precision=tcfg.precision,
        engine_dtype=str(next(engine.model.parameters()).dtype),
        digests_ok=digests_ok,
        image_pinned=image_pinned,
        **whole,
        torch=torch.__version__,
    )
    if cuda:
        out["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def whole_installs(engine: HFEngine, cuda: bool, repeats: int = 5) -> dict[str, float]:
    """One whole-state install into the engine's parameters from pageable host memory, and (on CUDA) from pinned host
    memory with non-blocking copies: medians of ``repeats`` each, the engine's own weights as the source."""
    pageable = to_bf16_state(engine.state_view())
    sources = {"pageable": pageable, **({"pinned": pinned_host(pageable)} if cuda else {})}
    out: dict[str, float] = {}
    for kind, state in sources.items():
        times = []
        for _ in range(repeats):
            _sync(cuda)
            t0 = time.perf_counter()
            copy_weights(engine.model, state)
            _sync(cuda)
            times.append(time.perf_counter() - t0)
        out[f"install_whole_{kind}_s"] = round(statistics.median(times), 4)
    return out


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--arch", choices=["qwen2", "qwen3_moe"], default="qwen2")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=64, help="tasks per iteration")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--sft-steps", type=int, default=30, help="warm start, so that groups hold mixed rewards and steps move weights")
    ap.add_argument("--sft-lr", type=float, default=5e-4)
    args = ap.parse_args()
    return asyncio.run(check(args))


if __name__ == "__main__":
    print(json.dumps(main()))
