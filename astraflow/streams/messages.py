"""Wire messages of the plane. Every message is a frozen pydantic model with a schema version.

Per-token arrays travel as packed little-endian bytes (``I32``/``F32``/``U8``), never as lists
of Python ints; ``.ids()``-style accessors return zero-copy numpy views. Each field's comment
says who writes it and who reads it.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1


def _packer(dtype: str):
    def pack(value: Any) -> bytes:
        if isinstance(value, (bytes, bytearray, memoryview)):
            raw = bytes(value)
            if len(raw) % np.dtype(dtype).itemsize:
                raise ValueError(f"packed {dtype} array has {len(raw)} bytes, not a multiple of its item size")
            return raw
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
    v: int = SCHEMA_VERSION  # schema version, checked by the codec


class Task(Message):
    """A prompt to roll out ``group_size`` times. Written by dataflow, read by RaaS nodes."""

    kind: ClassVar[str] = "task"
    task_id: str
    workflow: str
    policy: str  # the policy that solves the prompt (a workflow may call others too)
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
    traj_id: str
    task_id: str
    prompt_id: str
    policy: str  # the policy whose tokens these are (routing key)
    index: int  # position within the task's group
    group_size: int
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
    policy: str
    trajectories: list[Trajectory]
    advantages: F32  # one per trajectory, aligned with ``trajectories``
    task_ids: list[str]  # tasks whose groups this batch trains (accounting)
    created_at: float = Field(default_factory=time.time)

    def advantage_array(self) -> np.ndarray:
        return unpack(self.advantages, "<f4")


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
    policy: str
    version: int
    encoding: Literal["keyframe", "delta"]
    base_version: int | None = None  # deltas apply onto exactly this version
    base_digest: str | None = None  # state digest of the base (checked before applying)
    state_digest: str  # digest of the bf16 state after applying
    keyframe_version: int  # latest keyframe at or before this version
    objects: list[ObjectRef]
    batch_ids: list[str] = []
    metrics: dict[str, float] = {}
    created_at: float = Field(default_factory=time.time)


class Heartbeat(Message):
    """Liveness and live stats of a worker. Written by every worker, read by dataflow and `status`."""

    kind: ClassVar[str] = "heartbeat"
    role: Literal["dataflow", "rollout", "trainer", "launcher"]
    worker_id: str
    pool: str = ""
    region: str = ""
    hardware: str = ""
    policy: str = ""
    version: int = -1
    stats: dict[str, float] = {}
    state: Literal["starting", "running", "draining", "stopped"] = "running"
    ts: float = Field(default_factory=time.time)


class Rejected(Message):
    """A message that failed to decode or validate. Written by any worker to the DLQ; read by operators."""

    kind: ClassVar[str] = "rejected"
    subject: str
    reason: str
    worker_id: str
    headers: dict[str, str] = {}
    payload: bytes  # the original bytes, untouched
    ts: float = Field(default_factory=time.time)


KINDS: dict[str, type[Message]] = {m.kind: m for m in (Task, Trajectory, Batch, WeightVersion, Heartbeat, Rejected)}
