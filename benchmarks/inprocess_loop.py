"""The simplest single-process RL loop, built from the project's own pieces: no plane, no processes.

One step: 8 training prompts drawn at random, each answered ``group_size`` times by ``model.generate`` (the ``hf``
engine a rollout node runs, through the recipe's workflow and verifier), GRPO advantages per group (the
dataflow's advantage plug-in), one optimizer step on the recipe's loss (the torch trainer backend's
``step``: PPO-clip against the sampling logprobs, AdamW, gradient clipping), and the next step samples from
the updated weights. Held-out accuracy is the evaluator's own function (greedy, the same held-out prompts).

Its clock runs only while it trains: evaluations are taken on a stopped clock, so the baseline gets them
free (``astraflow up`` pays for its evaluator with CPU the other roles could use).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from astraflow.algorithms import Group, build_pipeline
from astraflow.config import Recipe
from astraflow.dataflow.groups import to_sample
from astraflow.models import build_model, load_tokenizer, model_limits
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.hf import HFEngine
from astraflow.rollout.evaluator import evaluate_with_workflow, scorable
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.registry import get_workflow
from astraflow.streams.messages import Batch, Task, Trajectory, TrajRef
from astraflow.streams.trajectories import TrainingBatch
from astraflow.tasks import load_split
from astraflow.train.sft import sft
from astraflow.train.torch_backend import TorchBackend


@dataclass(frozen=True)
class Point:
    """One held-out evaluation: of the weights after ``version`` steps, made ``seconds`` into RL, after ``samples`` rollouts."""

    version: int
    seconds: float
    samples: int
    held_out: float


@dataclass
class Curve:
    """What one side did in its RL time: held-out points, and the rollouts generated / trained on."""

    name: str
    points: list[Point] = field(default_factory=list)
    seconds: float = 0.0
    generated: int = 0
    trained: int = 0
    notes: dict[str, float] = field(default_factory=dict)


def warm_start(recipe: Recipe, out: Path, threads: int) -> float:
    """The recipe's SFT warm start, once, saved as a transformers checkpoint in ``out``; returns the last SFT loss."""
    pcfg = recipe.policies[recipe.primary]
    torch.set_num_threads(threads)
    torch.manual_seed(pcfg.trainer.seed)  # the same initial weights on every run, as the trainer takes them
    tokenizer = load_tokenizer(pcfg.model.tokenizer)
    model = build_model(pcfg.model, tokenizer)
    loss = sft(model, tokenizer, load_split(recipe.data)[0], pcfg.sft, pcfg.trainer.seed)
    model.save_pretrained(out)
    return loss


def training_batch(trajectories: list[Trajectory], advantages: dict[str, float], step: int, policy: str) -> TrainingBatch:
    """The trajectories of one step as the trainer receives them: a manifest (references, advantages) and the trajectories."""
    refs = [TrajRef(seq=k + 1, traj_id=t.traj_id, task_id=t.task_id) for k, t in enumerate(trajectories)]
    manifest = Batch(batch_id=f"{policy}-inproc{step:06d}", policy=policy, refs=refs,
                     advantages=[advantages[t.traj_id] for t in trajectories], task_ids=sorted({t.task_id for t in trajectories}))
    return TrainingBatch(manifest, trajectories)


def run_inprocess(recipe: Recipe, seconds: float, eval_every: int, threads: int,
                  on_step: Callable[[float], None] | None = None) -> Curve:
    """RL for ``seconds`` of training time from the recipe's model (the warm-start checkpoint) with ``threads`` torch
    threads, evaluating every ``eval_every`` steps, at the start and at the end. ``on_step(elapsed)`` reports progress."""
    policy = recipe.primary
    pcfg, r, d = recipe.policies[policy], recipe.rollout, recipe.dataflow
    torch.set_num_threads(threads)
    torch.manual_seed(pcfg.trainer.seed)
    tokenizer = load_tokenizer(pcfg.model.tokenizer)
    model = build_model(pcfg.model, tokenizer)
    engine = HFEngine(model, tokenizer)  # the same module the backend trains: the next step samples the new weights
    backend = TorchBackend(model, tokenizer, pcfg.trainer, temperature=r.temperature)
    handle = PolicyHandle(engine, tokenizer, SamplingParams(r.max_new_tokens, r.temperature, r.top_p), name=policy,
                          context=model_limits(pcfg.model).context)
    workflow = get_workflow(recipe.workflow_options, get_reward(recipe.reward))
    pipeline = build_pipeline(d.algorithms)
    train, held_out = load_split(recipe.data)
    held_out = scorable(recipe, held_out)
    rng = random.Random(recipe.data.seed)
    curve = Curve("in-process")
    engine.set_version(0)

    def evaluate(version: int) -> None:
        reward = evaluate_with_workflow(recipe, handle, policy, held_out)["reward"]
        curve.points.append(Point(version, curve.seconds, curve.generated, reward))

    evaluate(0)
    version, losses, step_s = 0, [], 0.0
    while curve.seconds < seconds:
        t0 = time.perf_counter()
        tasks = [Task(task_id=f"s{version}-{i}", workflow=recipe.workflow, policy=policy, prompt_id=p.prompt_id, prompt=p.prompt,
                      group_size=d.group_size, meta=p.meta) for i, p in enumerate(rng.sample(train, d.groups_per_batch))]
        trajectories = workflow.run(tasks, {policy: handle}, "inprocess")
        advantages: dict[str, float] = {}
        for task in tasks:
            group = [t for t in trajectories if t.task_id == task.task_id]
            samples = tuple(to_sample(t) for t in group)
            values = pipeline.advantages(Group(task.task_id, task.prompt_id, policy, samples))
            advantages.update(zip((t.traj_id for t in group), values, strict=True))
        t1 = time.perf_counter()
        step = backend.step(training_batch(trajectories, advantages, version, policy))
        step_s += time.perf_counter() - t1
        version += 1
        engine.set_version(version)
        losses.append(step["loss"])
        curve.generated += len(trajectories)
        curve.trained += len(trajectories)
        curve.seconds += time.perf_counter() - t0
        if on_step is not None:
            on_step(curve.seconds)
        if version % eval_every == 0:
            evaluate(version)
    if curve.points[-1].version != version:
        evaluate(version)
    curve.notes = {"versions": version, "s_per_step": curve.seconds / max(1, version), "step_s": step_s / max(1, version)}
    return curve
