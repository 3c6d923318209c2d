"""Scripted experts play a recipe's own workflow, to record demonstrations for the SFT warm start.

An expert writes one turn from the task and the episode's text so far. A script engine
(``engines/testing.py``) asks the current episode's expert instead of a model; a turn that does not
end with one of the request's stop strings gets the end-of-sequence token, as a model's final turn
would, and a turn longer than ``rollout.max_new_tokens`` is an error (a model could not write it). The
workflow runs as in RL (it calls the tools, steps the environment, inserts their output), so a
recorded episode is exactly what the model will see, and its segments carry the trajectory's
``loss_mask``: text the expert wrote is trained on, text the workflow inserted is not.

Each episode is played alone (``group_size`` 1) with a fresh expert from the factory, so an
expert may hold per-episode state: a recipe's noisy demonstrator draws at the start of an episode
whether it plays carefully (the skill) or carelessly (a habit RL has to unlearn).

    def make_expert(rng: random.Random) -> Expert: ...
    demos = record(recipe, {"solver": make_expert}, train_problems, per_problem=2, seed=0)
    write_demonstrations("recipes/search/demos.jsonl", demos["solver"])
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from astraflow.config import Recipe, load_recipe
from astraflow.demonstrations import Demonstration, segment_ids, write_demonstrations
from astraflow.models import encode_prompt, load_tokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.testing import ScriptEngine
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.registry import check_policies, get_workflow
from astraflow.streams.messages import Task, Trajectory
from astraflow.tasks import Problem, load_split

Expert = Callable[[Task, str], str]
"""``expert(task, context) -> the next turn's text``; ``context`` is the decoded prompt and episode so far."""
ExpertFactory = Callable[[random.Random], Expert]
"""A fresh expert per episode, drawing its randomness from the given generator."""


def demonstration(traj: Trajectory, tokenizer: Any) -> Demonstration:
    """A trajectory as text segments: runs of equal ``loss_mask``, the final end-of-sequence token as ``eos``. An
    end-of-turn token inside the episode (an agent's turn that ends in a tool call) stays in its segment's text."""
    ids, mask = traj.completion().tolist(), traj.mask().tolist()
    eos = bool(ids) and ids[-1] == tokenizer.eos_token_id and mask[-1] == 1
    if eos:
        ids, mask = ids[:-1], mask[:-1]
    segments: list[tuple[str, bool]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(ids[start:i])
            if segment_ids(tokenizer, text) != ids[start:i]:
                raise ValueError(f"{traj.traj_id}: tokens {ids[start:i]} do not come back from their text {text!r}")
            segments.append((text, bool(mask[start])))
            start = i
    prompt = tokenizer.decode(traj.prompt_tokens().tolist())
    return Demonstration(prompt_id=traj.prompt_id, prompt=prompt, segments=segments, eos=eos, reward=traj.reward)


def record(recipe: Recipe, experts: Mapping[str, ExpertFactory], problems: list[Problem], per_problem: int = 1,
           seed: int = 0) -> dict[str, list[Demonstration]]:
    """``per_problem`` episodes of each problem through the recipe's workflow, every policy played by its expert;
    the demonstrations of each policy."""
    check_policies(recipe.workflow, recipe.policy_names)
    missing = set(recipe.policy_names) - set(experts)
    if missing:
        raise ValueError(f"no expert for the policies {sorted(missing)}")
    workflow = get_workflow(recipe.workflow_options, get_reward(recipe.reward))
    rng = random.Random(seed)
    limit = recipe.rollout.max_new_tokens
    engines, handles = {}, {}
    for p in recipe.policy_names:
        tokenizer = load_tokenizer(recipe.policies[p].model.tokenizer)
        engines[p] = ScriptEngine(tokenizer, lambda context: "", logprob=0.0)
        handles[p] = PolicyHandle(engines[p], tokenizer, SamplingParams(limit, temperature=0.0), name=p)
    out: dict[str, list[Demonstration]] = {p: [] for p in recipe.policy_names}
    for problem in problems:
        for i in range(per_problem):
            task = Task(task_id=f"demo-{problem.prompt_id}-{i}", workflow=recipe.workflow, policy=recipe.primary,
                        prompt_id=problem.prompt_id, prompt=problem.prompt, group_size=1, meta=problem.meta)
            for p in recipe.policy_names:
                engines[p].reply = _turns(experts[p](rng), task, handles[p].tokenizer, limit)
            for traj in workflow.run([task], handles, "demonstrator"):
                out[traj.policy].append(demonstration(traj, handles[traj.policy].tokenizer))
    return out


def _turns(expert: Expert, task: Task, tokenizer: Any, limit: int) -> Callable[[str], str]:
    def reply(context: str) -> str:
        text = expert(task, context)
        if len(encode_prompt(tokenizer, text)) >= limit:  # room for the end-of-sequence token too
            raise ValueError(f"the expert wrote {text!r}: longer than rollout.max_new_tokens ({limit}) allows")
        return text

    return reply


def record_recipe_demonstrations(folder: Path, expert: ExpertFactory, per_problem: int = 2, seed: int = 0,
                                 limit: int | None = None) -> list[Demonstration]:
    """What each recipe's ``make_data.py`` ends with: the recipe in ``folder`` played by ``expert`` (its primary policy)
    on its training problems (the first ``limit`` of them when given, so that RL also meets episodes the warm start
    never saw), written to ``folder/demos.jsonl``; the demonstrations recorded."""
    recipe = load_recipe(folder)
    train, _ = load_split(recipe.data)
    demos = record(recipe, {recipe.primary: expert}, train[:limit], per_problem=per_problem, seed=seed)[recipe.primary]
    write_demonstrations(folder / "demos.jsonl", demos)
    return demos
