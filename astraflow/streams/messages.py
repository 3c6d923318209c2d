"""Wire messages of the plane. Every message is a frozen pydantic model with a schema version.

Per-token arrays travel as packed little-endian bytes (``I32``/``F32``/``U8``), never as lists
of Python ints; ``.ids()``-style accessors return zero-copy numpy views. Each field's comment
says who writes it and who reads it.

Two ways in: Python callers construct messages leniently (a per-token array may be a list or a
numpy array, packed on the way in), while the codec decodes what arrives from the wire strictly
(``model_validate(fields, strict=True, context=WIRE)``): a per-token array must be bytes of a
whole number of items, a number must be a number, never a string. So Python accepts from the
wire exactly what the exported JSON Schemas accept, bar the cross-field rules they list.
"""

from __future__ import annotations

import hashlib
import struct
import time
from typing import Annotated, Any, ClassVar, Final, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, model_validator

SCHEMA_VERSION: Final = 1
WIRE: Final = {"wire": True}
"""Validation context of a message decoded from the wire: strict, per-token arrays only as bytes."""
TOKEN_PATTERN: Final = r"^[A-Za-z0-9_-]{1,64}$"
Token = Annotated[str, Field(pattern=TOKEN_PATTERN)]  # a NATS subject token: policy and workflow names
_TRAJ_LENGTHS = struct.Struct("<12Q")  # Batch.digest: the lengths of a trajectory's 12 hashed fields


def _packer(dtype: str) -> BeforeValidator:
    def pack(value: Any, info: ValidationInfo) -> bytes:
        if isinstance(value, (bytes, bytearray, memoryview)):
            raw = bytes(value)
            if len(raw) % np.dtype(dtype).itemsize:
                raise ValueError(f"packed {dtype} array has {len(raw)} bytes, not a multiple of its item size")
            return raw
        if isinstance(info.context, dict) and info.context.get("wire"):
            raise ValueError(f"a packed {dtype} array travels as bytes (msgpack bin), not as {type(value).__name__}")
        return np.ascontiguousarray(np.asarray(value), dtype=dtype).tobytes()

    return BeforeValidator(pack)


I32 = Annotated[bytes, _packer("<i4")]  # int32 little-endian
F32 = Annotated[bytes, _packer("<f4")]  # float32 little-endian
U8 = Annotated[bytes, _packer("<u1")]


def unpack(raw: bytes, dtype: str) -> np.ndarray:
    return np.frombuffer(raw, dtype=dtype)


class Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: ClassVar[str]
    v: Literal[1] = SCHEMA_VERSION  # schema version, checked by the codec


class Task(Message):
    """A prompt to roll out ``group_size`` times. Written by dataflow, read by RaaS nodes."""

    kind: ClassVar[str] = "task"
    task_id: str
    workflow: Token
    policy: Token  # the policy that solves the prompt (a workflow may call others too)
    prompt_id: str
    prompt: str
    group_size: int = Field(ge=1)
    meta: dict[str, Any] = {}  # what the reward needs (reference answer, tests, …)
    min_versions: dict[str, int] = {}  # per policy: a node must hold at least this weight version to serve the task
    created_at: float = Field(default_factory=time.time)
    deadline: float | None = None  # unix seconds after which the result is late


class Trajectory(Message):
    """One finished sample. Written by a RaaS node, read by dataflow (and replay / audit)."""

    kind: ClassVar[str] = "trajectory"
    traj_id: str  # "{task_id}.{policy}.{index}": one id per sample (the plane dedups on it; the dataflow checks it)
    task_id: str
    prompt_id: str
    policy: Token  # the policy whose tokens these are (routing key)
    index: int = Field(ge=0)  # position within the task's group
    group_size: int = Field(ge=1)
    prompt_ids: I32
    completion_ids: I32
    logprobs: F32  # behaviour logprob of each completion token, aligned with completion_ids
    versions: I32  # weight version that produced each completion token, aligned with completion_ids
    loss_mask: U8  # 1 = trained on (generated), 0 = masked (tool output), aligned with completion_ids
    reward: float | None
    finish_reason: Literal["stop", "length", "error"] = "stop"
    node_id: str = ""
    created_at: float = Field(default_factory=time.time)
    meta: dict[str, Any] = {}

    @model_validator(mode="after")
    def _aligned(self) -> "Trajectory":
        """Cross-field rules (listed in the schema's ``x-astraflow-rules``: JSON Schema cannot say them)."""
        n = len(self.completion_ids) // 4
        sizes = {"logprobs": len(self.logprobs) // 4, "versions": len(self.versions) // 4, "loss_mask": len(self.loss_mask)}
        bad = {k: s for k, s in sizes.items() if s != n}
        if bad:
            raise ValueError(f"per-token arrays must align with {n} completion tokens, got {bad}")
        return self

    def completion(self) -> np.ndarray:
        return unpack(self.completion_ids, "<i4")

    def prompt_tokens(self) -> np.ndarray:
        return unpack(self.prompt_ids, "<i4")

    def behaviour_logprobs(self) -> np.ndarray:
        return unpack(self.logprobs, "<f4")

    def token_versions(self) -> np.ndarray:
        return unpack(self.versions, "<i4")

    def mask(self) -> np.ndarray:
        return unpack(self.loss_mask, "<u1")

    @property
    def min_version(self) -> int:
        v = self.token_versions()
        return int(v.min()) if len(v) else 0


class Batch(Message):
    """A training batch for one policy. Written by dataflow, read by that policy's trainer."""

    kind: ClassVar[str] = "batch"
    batch_id: str
    policy: Token
    trajectories: list[Trajectory]
    advantages: F32  # one per trajectory, aligned with ``trajectories``
    task_ids: list[str]  # tasks whose groups this batch trains (accounting)
    created_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _aligned(self) -> "Batch":
        if len(self.advantages) // 4 != len(self.trajectories):
            raise ValueError(f"advantages must hold one value per trajectory: {len(self.advantages) // 4} for {len(self.trajectories)}")
        return self

    def advantage_array(self) -> np.ndarray:
        return unpack(self.advantages, "<f4")

    def digest(self) -> str:
        """sha256 of everything a trainer trains on: ids, tasks, advantages and, per trajectory, its ids,
        tokens, logprobs, versions, mask, reward and finish reason (not ``created_at``, ``node_id``, ``meta``).
        The dataflow's plan record holds it; the trainer trains a batch only if it matches."""
        head = [x.encode() for x in (self.batch_id, self.policy, *self.task_ids)]
        parts: list[bytes] = [struct.pack(f"<{len(head) + 2}Q", len(head), len(self.advantages), *(len(x) for x in head)),
                              *head, self.advantages]
        for t in self.trajectories:  # every field length-prefixed: no two different contents hash the same way
            fields = (t.traj_id.encode(), t.task_id.encode(), t.policy.encode(), str(t.index).encode(), str(t.group_size).encode(),
                      repr(t.reward).encode(), t.finish_reason.encode(), t.prompt_ids, t.completion_ids, t.logprobs, t.versions, t.loss_mask)
            parts.append(_TRAJ_LENGTHS.pack(*(len(f) for f in fields)))
            parts.extend(fields)
        return hashlib.sha256(b"".join(parts)).hexdigest()


class ObjectRef(BaseModel):
    """Where a payload lies in the object store, and how to check it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    nuid: str  # chunks live on the subject $O.{bucket}.C.{nuid}
    size: int
    chunk_size: int
    digests: list[str]  # sha256 hex of every chunk, in order
    digest: str  # sha256 hex of the whole payload


class WeightVersion(Message):
    """Announcement of a weight version. Written by a trainer (last, as the commit point); read by RaaS nodes."""

    kind: ClassVar[str] = "weight_version"
    policy: Token
    version: int
    encoding: Literal["keyframe", "delta"]
    base_version: int | None = None  # deltas apply onto exactly this version
    base_digest: str | None = None  # state digest of the base (checked before applying)
    state_digest: str  # digest of the bf16 state after applying
    keyframe_version: int  # latest keyframe at or before this version
    objects: list[ObjectRef]
    batch_ids: list[str] = []
    metrics: dict[str, float] = {}
    lineage: str = ""  # the weight lineage this version belongs to (a trainer that starts over makes a new one)
    created_at: float = Field(default_factory=time.time)


class _Stats(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def summary(self) -> dict[str, float]:
        """The headline figures, for dashboards (``status``, the live view of ``up``)."""
        return {k: float(v) for k, v in self.model_dump().items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class RolloutStats(_Stats):
    """A RaaS node's cumulative counters. Read by the dataflow (``gen_s``: autoscale) and the launcher (``trajectories``)."""

    role: Literal["rollout"] = "rollout"
    tasks: int = 0  # tasks served (their trajectories published, then acked)
    trajectories: int = 0
    tokens: int = 0  # completion tokens generated
    gen_s: float = 0.0  # seconds spent generating (busy time)
    pull_s: float = 0.0
    publish_s: float = 0.0
    refresh_s: float = 0.0  # seconds spent fetching and applying weights
    failed: int = 0  # tasks whose workflow failed (nak'ed or dead-lettered)
    held: int = 0  # tasks in hand now
    joined: bool = False  # holds weights and pulls tasks (or serves agent sessions)
    endpoint: str = ""  # the node's OpenAI-compatible endpoint for agents (workflow openai_agent), "" when none
    counters: dict[str, float] = {}  # other diagnostics (stale_naks, drained_naks, refresh_errors, …)
    weights: dict[str, dict[str, float]] = {}  # per policy: weight-sync counters (deltas, keyframes, fallbacks, …)


class TrainerStats(_Stats):
    """A trainer's waiting and its last step. Read by the dataflow (``wait_s``: autoscale) and the launcher."""

    role: Literal["trainer"] = "trainer"
    wait_s: float = 0.0  # cumulative seconds spent waiting for a batch
    wait_frac: float = 0.0  # wait_s over the trainer's wall time
    bytes_sent: int = 0  # weight payload bytes published
    step: dict[str, float] = {}  # the last step's metrics (loss, reward_mean, tokens_per_s, grad_norm, …)

    def summary(self) -> dict[str, float]:
        return {**self.step, "wait_frac": self.wait_frac, "wait_s": self.wait_s}


class DataflowStats(_Stats):
    """The dataflow's regulation at a glance. Read by the launcher and ``status``."""

    role: Literal["dataflow"] = "dataflow"
    issued: int = 0
    in_flight: int = 0
    buffered: int = 0
    batches: int = 0
    overdue: int = 0  # tasks in flight past their deadline
    wait_frac: float = 0.0  # the most-starved trainer's waiting share (autoscale input)
    produce_rate: float = 0.0  # groups completed per second
    consume_rate: float = 0.0  # groups trained per second
    autoscale_target: int = 0
    autoscale_nodes: int = 0
    counters: dict[str, float] = {}  # other diagnostics (duplicates, redelivered_settled, …)
    policies: dict[str, dict[str, float]] = {}  # per policy: lane figures (buffered, awaiting, fates, lag, …)


class EvaluatorStats(_Stats):
    role: Literal["evaluator"] = "evaluator"
    evaluated: int = 0  # versions evaluated by this process
    last_version: int = -1
    last_reward: float = 0.0


HeartbeatStats = Annotated[RolloutStats | TrainerStats | DataflowStats | EvaluatorStats, Field(discriminator="role")]


class Heartbeat(Message):
    """Liveness and live stats of a worker, every 2 s on core NATS. Written by every worker, read by dataflow,
    the launcher and ``status``. A worker silent for 3 beats is gone."""

    kind: ClassVar[str] = "heartbeat"
    worker_id: str
    pool: str = ""
    region: str = ""
    hardware: str = ""
    policy: str = ""
    version: int = -1
    stats: HeartbeatStats
    state: Literal["starting", "running", "draining", "stopped"] = "running"
    metrics: str = ""  # HOST:PORT of its Prometheus endpoint, when it serves one
    ts: float = Field(default_factory=time.time)

    @property
    def role(self) -> str:
        return self.stats.role


class Rejected(Message):
    """A message that failed to decode or validate. Written by any worker to the DLQ; read by operators."""

    kind: ClassVar[str] = "rejected"
    subject: str
    reason: str
    worker_id: str
    headers: dict[str, str] = {}
    payload: bytes  # the original bytes, untouched
    ts: float = Field(default_factory=time.time)


# Why a trainer turned a batch away: ``Rejected.reason`` starts with one of these and ": ". The dataflow
# reads them: ``stale`` -> its tasks are ``dropped:stale``; ``forged`` (another content under a planned
# id: the planned batch may still come) -> no fate; anything else -> ``failed:train``.
BATCH_STALE = "stale"
BATCH_FORGED = "forged"
BATCH_UNPLANNED = "unplanned"  # no plan record: not a batch the dataflow planned (or its plan is gone)
BATCH_INVALID = "invalid"  # values a trainer cannot train (policy, advantages, token ids)
BATCH_NON_FINITE = "non_finite"  # the step's loss or gradient norm was not finite: no update was made
BATCH_STEP_FAILED = "step_failed"


def reason_code(reason: str) -> str:
    """The code a rejection reason starts with (``"stale: oldest token v3, ..."`` -> ``"stale"``)."""
    return reason.split(":", 1)[0].strip()


KINDS: dict[str, type[Message]] = {m.kind: m for m in (Task, Trajectory, Batch, WeightVersion, Heartbeat, Rejected)}
HEARTBEAT_PERIOD_S = 2.0
