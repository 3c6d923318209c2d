"""What a trainer checks before it trains a batch, and before it announces weights.

A batch arrives as a manifest (``Batch``: trajectory references, task ids, advantages); the
trainer checks the manifest (:func:`check_plan`, :func:`check_manifest`), fetches the
trajectories it names from the TRAJ stream, and checks them (:func:`check_batch`). A batch is
trained only when all of these hold; otherwise it is dead-lettered with its typed refusal
(``Rejected.code``, a ``streams.messages.BatchRefusal``), which the dataflow reads:

| code | the batch is turned away when |
|---|---|
| ``unplanned`` | no plan record ``plan.{policy}.{batch_id}``: the dataflow never planned it (or its fate is known already) |
| ``forged`` | the manifest does not hash to the plan's digest (``Batch.digest``): not the batch that was planned under that id |
| ``invalid`` | another policy's batch, advantages not one finite value per trajectory, a token id outside the model's vocabulary |
| ``missing`` | a referenced trajectory is gone from the TRAJ stream (past its max age), or its arrays from the object store |
| ``mismatch`` | a referenced sequence holds another trajectory, task or policy than the manifest names |
| ``stale`` | its oldest token is more than ``max_staleness + max_batch_backlog`` versions behind the trainer (see :func:`allowed_lag`) |

A trained batch's trajectories whose behaviour logprobs the policy's own contradict (``trainer.max_logprob_gap``,
``train/objective.py``) are left out of the step and announced with its version (``WeightVersion.suspects``,
:func:`suspects_of`), each with the node its TRAJ subject names: the dataflow counts them against that node.

A step whose loss or gradient norm is not finite makes no update (the backend skips it) and
its batch is dead-lettered ``non_finite``. Weights are checked finite before every checkpoint
and announcement (``weights/finite.py``); the publisher refuses non-finite weights too.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from astraflow.config import Recipe
from astraflow.streams.messages import Batch, BatchRefusal, Refusal, Suspect, Trajectory
from astraflow.streams.plane import Plane
from astraflow.streams.state import BatchPlanRecord, StateSchemaError
from astraflow.streams.trajectories import TrainingBatch


def allowed_lag(recipe: Recipe) -> int:
    """How far behind the trainer a batch's oldest token may be when it is trained.

    The dataflow serves a group only within ``max_staleness`` versions of the trainer's version as
    it last heard it, and at most ``max_batch_backlog`` batches (one version each) wait ahead of a
    new batch. A batch lagging more than the sum was not trained when planned: it is a redelivery
    after a dead trainer, or a copy from elsewhere, and training it would break the recipe's bound.
    """
    return recipe.dataflow.max_staleness + recipe.dataflow.max_batch_backlog


def check_manifest(batch: Batch, policy: str) -> Refusal | None:
    """What the manifest alone says is wrong (before anything is fetched); a rejection reason, or None."""
    if batch.policy != policy:
        return Refusal(BatchRefusal.INVALID, f"a batch of {batch.policy!r} for the trainer of {policy!r}")
    adv = batch.advantage_array()
    if not batch.refs or len(adv) != len(batch.refs):
        return Refusal(BatchRefusal.INVALID, f"{len(adv)} advantages for {len(batch.refs)} trajectories")
    if not np.isfinite(adv).all():
        return Refusal(BatchRefusal.INVALID, f"{int((~np.isfinite(adv)).sum())} non-finite advantages")
    return None


def check_batch(batch: TrainingBatch, vocab: int, version: int, max_lag: int) -> Refusal | None:
    """The fetched trajectories: each is the one its reference names (id, task, policy), its token ids fit the
    model, then staleness; a rejection reason, or None."""
    policy = batch.policy
    for ref, t in zip(batch.manifest.refs, batch.trajectories, strict=True):
        if (t.traj_id, t.task_id, t.policy) != (ref.traj_id, ref.task_id, policy):
            return Refusal(BatchRefusal.MISMATCH, f"sequence {ref.seq} holds {t.traj_id} (task {t.task_id}, policy {t.policy}), "
                    f"the manifest names {ref.traj_id} (task {ref.task_id}, policy {policy})")
    if _outside(vocab, *batch.trajectories):  # one pass over the batch; then the first culprit, named
        t = next(t for t in batch.trajectories if _outside(vocab, t))
        ids = _token_ids(t)
        return Refusal(BatchRefusal.INVALID,
                       f"{t.traj_id} has token ids in [{int(ids.min())}, {int(ids.max())}], the vocabulary is [0, {vocab})")
    oldest = min(t.min_version for t in batch.trajectories)
    if version - oldest > max_lag:
        return Refusal(BatchRefusal.STALE,
                       f"oldest token v{oldest}, trainer at v{version}: {version - oldest} versions behind, {max_lag} allowed")
    return None


def _token_ids(*trajectories: Trajectory) -> np.ndarray:
    """The prompt and completion token ids of ``trajectories``, joined."""
    return np.concatenate([np.zeros(0, "<i4"), *(np.frombuffer(b, "<i4") for t in trajectories for b in (t.prompt_ids, t.completion_ids))])


def _outside(vocab: int, *trajectories: Trajectory) -> bool:
    """Whether any token id of ``trajectories`` lies outside ``[0, vocab)``."""
    ids = _token_ids(*trajectories)
    return bool(len(ids)) and (int(ids.min()) < 0 or int(ids.max()) >= vocab)


def suspects_of(batch: TrainingBatch, gaps: Mapping[int, float]) -> list[Suspect]:
    """The trajectories of ``batch`` at the rows the step's token check left out (row -> logprob gap, the backend's
    ``suspects``), each with the node its subject named."""
    senders = batch.senders or [None] * len(batch.trajectories)
    return [Suspect(traj_id=batch.trajectories[i].traj_id, task_id=batch.trajectories[i].task_id, node=senders[i],
                    gap=round(gap, 4)) for i, gap in sorted(gaps.items())]


async def check_plan(plane: Plane, policy: str, batch: Batch) -> Refusal | None:
    """The batch is the one the dataflow planned under its id for ``policy``; a rejection reason, or None.
    A failed read raises (``StateReadError``): the batch is neither trained nor turned away."""
    try:
        plan = await plane.state.get(BatchPlanRecord, policy, batch.batch_id)
    except (ValueError, StateSchemaError) as e:  # an id that cannot be a key, or a record that is not one
        return Refusal(BatchRefusal.UNPLANNED, f"no valid plan record for {batch.batch_id!r}: {e}")
    if plan is None:
        return Refusal(BatchRefusal.UNPLANNED, f"the dataflow planned no batch {batch.batch_id!r} (or its fate is known already)")
    digest = batch.digest()
    if digest != plan.digest:
        return Refusal(BatchRefusal.FORGED, f"{batch.batch_id} names {len(batch.refs)} trajectories hashing to {digest[:16]}, "
                f"the plan {plan.trajectories} hashing to {plan.digest[:16]}")
    return None
