"""Tasks and trajectories for tests, built in one place: valid by default, any field overridden by keyword.

    a_task(3)                                   # t00000003, single_turn, "1+2=" answered "3", a group of 2
    a_trajectory("t00000003", 1, reward=0.0)    # its second sample: 3 prompt tokens, 2 completion tokens at v0
    honest(task, 1.0)                           # the prompt and completion an honest node sends for it (arithmetic)
    sampled_batches(MODEL, 2, seed=3)           # (policy config, tokenizer, batches) a tiny model sampled for a trainer
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from astraflow.models import encode_prompt, load_tokenizer
from astraflow.streams.messages import ObjectRef, Task, Trajectory, WeightVersion

BYT5 = load_tokenizer("byt5")


def task_id(i: int | str) -> str:
    return i if isinstance(i, str) else f"t{i:08d}"


def a_task(i: int | str = 1, *, prompt: str = "1+2=", answer: str | None = "3", group_size: int = 2, policy: str = "solver",
           workflow: str = "single_turn", prompt_id: str | None = None, **over: Any) -> Task:
    """Task ``i`` (a number becomes ``t%08d``; a string is the id); ``meta`` is ``{"answer": answer}`` unless
    ``answer`` is None or ``meta`` is given. Any other field in ``over`` replaces the default."""
    tid = task_id(i)
    fields: dict[str, Any] = dict(task_id=tid, workflow=workflow, policy=policy, prompt_id=prompt_id or f"p-{tid}", prompt=prompt,
                                  group_size=group_size, meta={"answer": answer} if answer is not None else {})
    fields.update(over)
    return Task(**fields)


def a_keyframe_announcement(version: int, policy: str = "solver") -> WeightVersion:
    """A well-formed keyframe announcement (its object is not stored: for what reads announcements only)."""
    digest = hashlib.sha256(f"{policy}-{version}".encode()).hexdigest()
    ref = ObjectRef(name=f"{policy}/v{version}", nuid=f"n{version}", size=0, chunk_size=1, digests=[digest], digest=digest)
    return WeightVersion(policy=policy, version=version, encoding="keyframe", state_digest=digest, keyframe_version=version,
                         objects=[ref])


def a_trajectory(task: int | str = 1, index: int = 0, *, policy: str = "solver", group_size: int = 2, n: int = 2,
                 prompt_ids: Sequence[int] | np.ndarray = (1, 2, 3), version: int = 0, logprob: float = -0.5,
                 reward: float | None = 1.0, prompt_id: str = "p", **over: Any) -> Trajectory:
    """Sample ``index`` of ``task`` for ``policy``: ``n`` completion tokens, each at ``version`` with ``logprob``, all
    trained on; ``traj_id`` follows the wire's ``{task_id}.{policy}.{index}``. Arrays given in ``over`` replace these."""
    tid = task_id(task)
    fields: dict[str, Any] = dict(
        traj_id=f"{tid}.{policy}.{index}", task_id=tid, prompt_id=prompt_id, policy=policy, index=index, group_size=group_size,
        prompt_ids=np.asarray(prompt_ids, np.int32), completion_ids=np.arange(10, 10 + n, dtype=np.int32),
        logprobs=np.full(n, logprob, np.float32), versions=np.full(n, version, np.int32), loss_mask=np.ones(n, np.uint8),
        reward=reward)
    fields.update(over)
    return Trajectory(**fields)


def honest(task: Task, reward: float | None, n: int = 4) -> dict[str, np.ndarray]:
    """``prompt_ids`` and ``completion_ids`` of a sample of an arithmetic ``task`` (``meta["answer"]``) that earns
    ``reward`` under the ``arithmetic`` reward and would pass the dataflow's claim checks: the issued prompt's tokens,
    and ``n`` completion tokens holding the answer (reward 1) or not (any other reward), padded with spaces."""
    text = str(task.meta.get("answer", "x")) if reward == 1.0 else "x"
    if len(text) > n:
        raise ValueError(f"answer {text!r} does not fit in {n} tokens")
    return {"prompt_ids": np.asarray(encode_prompt(BYT5, task.prompt), np.int32),
            "completion_ids": np.asarray(encode_prompt(BYT5, text.ljust(n)), np.int32)}


def sampled_batches(model: dict[str, Any], n_batches: int, seed: int) -> tuple[Any, Any, list[Any]]:
    """A recipe's policy config for a tiny model of ``model``'s shape, the tokenizer, and ``n_batches`` batches (3 groups
    of 4) that model sampled for the first arithmetic prompts, with noisy behaviour logprobs: what a trainer test steps on."""
    from astraflow.config import parse_recipe
    from astraflow.models import build_model
    from astraflow.tasks import load_split
    from astraflow.train.synthetic import sample_batches

    recipe = parse_recipe({"name": "t", "model": model})
    pcfg = recipe.policies["solver"]
    train, _ = load_split(recipe.data)
    batches = sample_batches(build_model(pcfg.model, BYT5), BYT5, [p.prompt for p in train[:8]], n_batches=n_batches,
                             groups_per_batch=3, group_size=4, logprob_noise=0.4, seed=seed)
    return pcfg, BYT5, batches
