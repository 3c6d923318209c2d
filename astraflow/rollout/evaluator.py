"""Held-out evaluation as its own process: it follows the weight stream and never stalls training.

It steps through versions 0, ``every``, 2·``every``, … and the last, plays each held-out prompt
once with greedy decoding and records the mean reward in the run-state KV
(``eval.{policy}.{version}``) where the launcher and ``status`` read it. Single-policy
workflows (single-turn, tools, environments) are evaluated through the recipe's own workflow,
so a tool-using agent is scored with its tools; multi-policy workflows score the evaluated
policy's single-turn answers with the recipe's reward.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from astraflow.config import Recipe
from astraflow.models import encode_prompt
from astraflow.rollout.engine import GenerationRequest, SamplingParams, close_engine
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.worker import load_plugins, make_handle
from astraflow.runtime import stop_event
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.tasks import load_split
from astraflow.weights.sync import WeightSync

log = logging.getLogger(__name__)


def eval_versions(recipe: Recipe) -> list[int]:
    every, last = recipe.eval.every, recipe.policies[recipe.eval_policy].trainer.steps
    return sorted({0, last, *range(every, last, every)})


SINGLE_POLICY_WORKFLOWS = ("single_turn", "multi_turn_tools", "env_http")


def evaluate_with_workflow(recipe: Recipe, handle: Any, policy: str, problems: list[Any]) -> dict[str, float]:
    """Each held-out prompt played once, greedily, through the recipe's workflow."""
    from dataclasses import replace

    from astraflow.rollout.workflows import get_workflow
    from astraflow.streams.messages import Task

    greedy = replace(handle, params=SamplingParams(recipe.rollout.max_new_tokens, temperature=0.0))
    workflow = get_workflow(recipe.workflow, get_reward(recipe.reward), recipe.rollout)
    tasks = [Task(task_id=f"eval-{i}", workflow=recipe.workflow, policy=policy, prompt_id=p.prompt_id, prompt=p.prompt,
                  group_size=1, meta=p.meta) for i, p in enumerate(problems)]
    trajs = [t for t in workflow.run(tasks, {policy: greedy}, "evaluator") if t.policy == policy]
    scores = [t.reward or 0.0 for t in trajs]
    return {"reward": sum(scores) / max(1, len(scores)), "n": float(len(scores))}


def evaluate(handle: Any, problems: list[Any], reward_name: str, max_new_tokens: int) -> dict[str, float]:
    reward = get_reward(reward_name)
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    reqs = [GenerationRequest(encode_prompt(handle.tokenizer, p.prompt), greedy) for p in problems]
    comps = handle.engine.generate(reqs)
    scores = [reward(handle.tokenizer.decode(c.token_ids, skip_special_tokens=True), p.meta) for c, p in zip(comps, problems)]
    return {"reward": sum(scores) / len(scores), "n": float(len(scores))}


async def serve(recipe: Recipe, nats: NatsOptions, run: str, worker_id: str = "evaluator") -> None:
    torch.set_num_threads(recipe.rollout.threads)
    plane = await Plane.connect(nats, run, worker_id)
    await plane.ensure_topology(recipe.topology())
    policy = recipe.eval_policy
    load_plugins(recipe.rollout.plugins)  # the recipe's reward may live in a plugin
    handle = make_handle(recipe, policy)
    sync = WeightSync(plane, policy, handle.engine)
    _, held_out = load_split(recipe.data)
    stop = stop_event()
    try:
        for v in eval_versions(recipe):
            while not stop.is_set() and int(await plane.state_get(f"version.{policy}", -1)) < v:
                await asyncio.sleep(0.5)
            if stop.is_set():
                break
            if await plane.state_get(f"eval.{policy}.{v}") is not None:
                continue  # already evaluated (a restarted evaluator)
            await sync.goto(v)
            if recipe.workflow in SINGLE_POLICY_WORKFLOWS:
                result = await asyncio.to_thread(evaluate_with_workflow, recipe, handle, policy, held_out)
            else:
                result = await asyncio.to_thread(evaluate, handle, held_out, recipe.reward, recipe.rollout.max_new_tokens)
            await plane.state_put(f"eval.{policy}.{v}", {**result, "version": v, "ts": time.time()})
            log.info("eval %s v%d: held-out reward %.3f", policy, v, result["reward"])
    finally:
        close_engine(handle.engine)
        await plane.close()
