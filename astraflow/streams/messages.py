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
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, ClassVar, Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler, ValidationInfo, model_validator
from pydantic_core import core_schema

SCHEMA_VERSION: Final = 1
WIRE: Final = {"wire": True}
"""Validation context of a message decoded from the wire: strict, per-token arrays only as bytes."""
TOKEN_PATTERN: Final = r"^[A-Za-z0-9_-]{1,64}$"
Token = Annotated[str, Field(pattern=TOKEN_PATTERN)]  # a NATS subject token: policy and workflow names


@dataclass(frozen=True)
class Packed:
    """A per-token array's type: packed little-endian items of ``dtype``. ``bytes`` are taken by pydantic's own
    (compiled) validator, with no Python call per field; a list or numpy array from a Python caller is packed here; on
    the wire (the ``WIRE`` context) only bytes pass. That the bytes are a whole number of items is checked by the
    message's model validator (:func:`whole_items`): one Python call per message, not one per array."""

    dtype: str

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def pack(self, value: Any, info: ValidationInfo) -> bytes:
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        if isinstance(info.context, dict) and info.context.get("wire"):
            raise ValueError(f"a packed {self.dtype} array travels as bytes (msgpack bin), not as {type(value).__name__}")
        return np.ascontiguousarray(np.asarray(value), dtype=self.dtype).tobytes()

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.union_schema([core_schema.bytes_schema(strict=True), core_schema.with_info_plain_validator_function(self.pack)],
                                        mode="left_to_right")

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return {"type": "string", "format": "binary"}


I32 = Annotated[bytes, Packed("<i4")]  # int32 little-endian
F32 = Annotated[bytes, Packed("<f4")]  # float32 little-endian
U8 = Annotated[bytes, Packed("<u1")]


_PACKED_FIELDS: dict[type[BaseModel], list[tuple[str, int]]] = {}  # per model: its packed fields of items over 1 byte


def whole_items(msg: BaseModel) -> None:
    """Every packed array of ``msg`` holds a whole number of items (ValueError naming the first that does not)."""
    fields = _PACKED_FIELDS.get(type(msg))
    if fields is None:
        fields = _PACKED_FIELDS[type(msg)] = [(name, m.itemsize) for name, info in type(msg).model_fields.items()
                                              for m in info.metadata if isinstance(m, Packed) and m.itemsize > 1]
    for name, size in fields:
        if len(getattr(msg, name)) % size:
            raise ValueError(f"{name}: a packed array of {len(getattr(msg, name))} bytes, not a whole number of {size}-byte items")


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


class ObjectRef(BaseModel):
    """Where a payload lies in the object store, and how to check it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    nuid: str  # chunks live on the subject $O.{bucket}.C.{nuid}
    size: int
    chunk_size: int
    digests: list[str]  # sha256 hex of every chunk, in order
    digest: str  # sha256 hex of the whole payload


def expert_id_dtype(experts: int) -> np.dtype:
    """How one expert id of a layer of ``experts`` travels: uint8 up to 256 experts, else little-endian uint16."""
    return np.dtype("u1") if experts <= 256 else np.dtype("<u2")


class RoutingLayout(BaseModel):
    """How a trajectory's ``routing`` bytes read (``astraflow/moe_routing.py``): expert ids per routed position, MoE
    layer and top-k slot, (positions, layers, top_k), uint8 when ``experts`` <= 256, else little-endian uint16."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[1] = 1  # version of the ids' layout: 1 = (positions, layers, top_k) (astraflow/moe_routing.py)
    layers: int = Field(ge=1, le=4096)  # MoE layers, in model order
    top_k: int = Field(ge=1, le=256)  # experts per position
    experts: int = Field(ge=2, le=65536)  # experts of each layer

    @property
    def itemsize(self) -> int:
        return expert_id_dtype(self.experts).itemsize

    @property
    def position_bytes(self) -> int:
        return self.layers * self.top_k * self.itemsize

    def ids(self, raw: bytes) -> np.ndarray:
        """(positions, layers, top_k) of ``raw`` (a whole number of positions)."""
        return np.frombuffer(raw, expert_id_dtype(self.experts)).reshape(-1, self.layers, self.top_k)


PER_TOKEN = ("prompt_ids", "completion_ids", "logprobs", "versions", "loss_mask", "routing")  # a Trajectory's packed arrays


class Trajectory(Message):
    """One finished sample. Written by a RaaS node, read by dataflow and trainers (and replay / audit).

    A trajectory whose encoding would exceed the server's ``max_payload`` (a long multi-turn episode)
    travels by reference: its arrays are one object in the run's trajectory bucket (``payload_ref``;
    ``streams/trajectories.py`` writes and resolves it) and empty here; readers resolve it first."""

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
    routing: U8 = b""  # MoE: the experts the engine routed each position of prompt + completion to (``routing_layout``)
    routing_layout: RoutingLayout | None = None  # how ``routing`` reads; None: no routing recorded
    reward: float | None
    finish_reason: Literal["stop", "length", "error"] = "stop"
    node_id: str = ""
    created_at: float = Field(default_factory=time.time)
    meta: dict[str, Any] = {}
    payload_ref: ObjectRef | None = None  # the arrays' object in the run's trajectory bucket when the whole would exceed max_payload

    @model_validator(mode="after")
    def _aligned(self) -> Trajectory:
        """Cross-field rules (listed in the schema's ``x-astraflow-rules``: JSON Schema cannot say them)."""
        if (len(self.prompt_ids) | len(self.completion_ids) | len(self.logprobs) | len(self.versions)) & 3:
            whole_items(self)  # some 4-byte array is not a whole number of items: named there
        if self.payload_ref is not None:
            held = [k for k in PER_TOKEN if getattr(self, k)]
            if held:
                raise ValueError(f"a trajectory whose arrays are in the object store carries none inline, got {held}")
            return self
        n = len(self.completion_ids) // 4
        sizes = {"logprobs": len(self.logprobs) // 4, "versions": len(self.versions) // 4, "loss_mask": len(self.loss_mask)}
        bad = {k: s for k, s in sizes.items() if s != n}
        if bad:
            raise ValueError(f"per-token arrays must align with {n} completion tokens, got {bad}")
        if self.routing or self.routing_layout is not None:
            self._routing_aligned(len(self.prompt_ids) // 4 + n - 1)
        return self

    def _routing_aligned(self, positions: int) -> None:
        """``routing`` holds whole positions of its layout, at most ``positions`` (prompt + completion - 1)."""
        layout = self.routing_layout
        if layout is None or not self.routing:
            raise ValueError("routing and routing_layout come together")
        size = layout.position_bytes
        if len(self.routing) % size or len(self.routing) // size > positions:
            raise ValueError(f"routing: {len(self.routing)} bytes, not a whole number of {size}-byte positions "
                             f"(layers x top_k x id size) up to {positions} (prompt + completion - 1)")

    def routes(self) -> np.ndarray | None:
        """The recorded routing, (positions, layers, top_k), or None."""
        return None if self.routing_layout is None else self.routing_layout.ids(self.routing)

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

    @property
    def offloaded(self) -> bool:
        """Its arrays are in the object store (``payload_ref``), not in this message."""
        return self.payload_ref is not None


MAX_GROUP = 4096  # trajectories one TrajectoryGroup may carry


class TrajectoryGroup(Message):
    """Several finished samples of one task for one policy in one message: what a RaaS node publishes when a task's
    group fits in ``max_payload`` (one publication, one delivery and one read for the lot instead of one each). The
    dataflow takes each trajectory as if it had come alone; a batch names one by the group's TRAJ stream sequence and
    its ``traj_id``. A trajectory too large for a message still travels alone, by reference."""

    kind: ClassVar[str] = "trajectory_group"
    task_id: str  # the task every trajectory here belongs to
    policy: Token  # the policy every trajectory here belongs to (routing key)
    trajectories: list[Trajectory] = Field(min_length=1, max_length=MAX_GROUP)  # whole (no payload_ref), distinct traj_ids

    @model_validator(mode="after")
    def _one_task(self) -> TrajectoryGroup:
        """Cross-field rules (listed in the schema's ``x-astraflow-rules``), in one pass."""
        ids = set()
        for t in self.trajectories:
            if t.task_id != self.task_id or t.policy != self.policy:
                raise ValueError(f"trajectory {t.traj_id} of task {t.task_id}/{t.policy} in a group of {self.task_id}/{self.policy}")
            if t.payload_ref is not None:
                raise ValueError(f"a group carries its trajectories whole; {t.traj_id} is by reference")
            ids.add(t.traj_id)
        if len(ids) != len(self.trajectories):
            raise ValueError("a traj_id appears twice in the group")
        return self

    @property
    def msg_id(self) -> str:
        """Its ``Nats-Msg-Id``: the task, the policy and a digest of the trajectory ids it carries, so a retry of the
        same group is deduplicated and a group of other samples of the task is not."""
        ids = hashlib.sha256("\n".join(t.traj_id for t in self.trajectories).encode()).hexdigest()[:16]
        return f"{self.task_id}.{self.policy}.group.{ids}"


MAX_BUNDLE = 1024  # task groups one TrajectoryBundle may carry; its trajectories, MAX_GROUP in all (what one group may)


class TrajectoryBundle(Message):
    """The groups of several tasks for one policy in one message: what a RaaS node publishes for the tasks it finished
    together (one publication, one delivery and one ack for the lot instead of one per task). Each group keeps its
    task's rules; the dataflow takes each group as if it had come alone (one over its task's size is dead-lettered
    alone, as a ``TrajectoryGroup``), and a batch names a trajectory by the bundle's TRAJ sequence and its ``traj_id``."""

    kind: ClassVar[str] = "trajectory_bundle"
    policy: Token  # the policy every group here belongs to (routing key)
    groups: list[TrajectoryGroup] = Field(min_length=1, max_length=MAX_BUNDLE)  # distinct tasks, distinct traj_ids

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        """At most ``MAX_GROUP`` trajectories in all, counted before any is validated: a bundle costs the reader no
        more than one group may (a hostile node's bundle of a thousand groups of thousands is refused unread)."""
        groups = data.get("groups") if isinstance(data, dict) else None
        if isinstance(groups, list):  # anything else is the field validation's to refuse
            lists = (g.get("trajectories") if isinstance(g, dict) else getattr(g, "trajectories", None) for g in groups)
            n = sum(len(t) for t in lists if isinstance(t, list))
            if n > MAX_GROUP:
                raise ValueError(f"{n} trajectories in one bundle, more than {MAX_GROUP}")
        return data

    @model_validator(mode="after")
    def _distinct(self) -> TrajectoryBundle:
        """Cross-field rules (listed in the schema's ``x-astraflow-rules``), in one pass."""
        tasks: set[str] = set()
        ids: set[str] = set()
        for g in self.groups:
            if g.policy != self.policy:
                raise ValueError(f"a group of policy {g.policy} in a bundle of {self.policy}")
            tasks.add(g.task_id)
            ids.update(t.traj_id for t in g.trajectories)
        if len(tasks) != len(self.groups):
            raise ValueError("a task_id has two groups in the bundle")
        if len(ids) != sum(len(g.trajectories) for g in self.groups):
            raise ValueError("a traj_id appears twice in the bundle")
        return self

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    @property
    def msg_id(self) -> str:
        """Its ``Nats-Msg-Id``: the policy and a digest of the trajectory ids it carries (a retry of the same bundle is
        deduplicated, a bundle of other samples is not)."""
        ids = hashlib.sha256("\n".join(t.traj_id for t in self.trajectories).encode()).hexdigest()[:16]
        return f"{self.policy}.bundle.{ids}"


class TrajRef(BaseModel):
    """Where a batch's trajectory lies: its TRAJ stream sequence, and the ids the trainer checks it against."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    seq: int = Field(ge=1)  # stream sequence in AF_{run}_TRAJ (Limits retention keeps it for replay and audit)
    traj_id: str  # the trajectory at ``seq``, or the one of that id in the trajectory group at ``seq``
    task_id: str


class Batch(Message):
    """A batch manifest for one policy: references to its trajectories, not the trajectories. Written by the
    dataflow, read by that policy's trainer, which fetches the trajectories from the TRAJ stream by sequence."""

    kind: ClassVar[str] = "batch"
    batch_id: str
    policy: Token
    refs: list[TrajRef]  # every trajectory, in batch order
    advantages: F32  # one per trajectory, aligned with ``refs``
    task_ids: list[str]  # tasks whose groups this batch trains (accounting), in batch order
    created_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _aligned(self) -> Batch:
        whole_items(self)
        if len(self.advantages) // 4 != len(self.refs):
            raise ValueError(f"advantages must hold one value per trajectory: {len(self.advantages) // 4} for {len(self.refs)}")
        return self

    def advantage_array(self) -> np.ndarray:
        return unpack(self.advantages, "<f4")

    def digest(self) -> str:
        """sha256 of what a trainer trains: ids, policy, tasks, advantages and every reference (sequence,
        trajectory id, task id); not ``created_at``. A stream sequence names one message for good, and the
        trainer checks each fetched trajectory's ids against its reference, so this binds the content too.
        The dataflow's plan record holds it; the trainer trains a batch only if it matches."""
        head = [x.encode() for x in (self.batch_id, self.policy, *self.task_ids)]
        refs = [x.encode() for r in self.refs for x in (r.traj_id, r.task_id)]
        lengths = struct.pack(f"<{len(head) + len(refs) + 3}Q", len(head), len(self.refs), len(self.advantages),
                              *(len(x) for x in head), *(len(x) for x in refs))  # every field length-prefixed
        seqs = struct.pack(f"<{len(self.refs)}Q", *(r.seq for r in self.refs))
        return hashlib.sha256(b"".join([lengths, *head, seqs, *refs, self.advantages])).hexdigest()


class Suspect(BaseModel):
    """A trajectory of a trained batch that the trainer's token check left out of the step: its behaviour logprobs
    differ from the policy's own by ``gap`` nats per trained token, over ``trainer.max_logprob_gap``. ``node``: the
    node its TRAJ stream subject names (the server vouched for it), None for a sender no subject names."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    traj_id: str
    task_id: str
    node: Token | None = None
    gap: float = Field(ge=0, allow_inf_nan=False)


class AdapterSpec(BaseModel):
    """What a LoRA version's state is (``trainer.lora.announce: adapter``, train/lora.py): each adapted linear layer's
    ``{module}.lora_A`` (r x in) and ``{module}.lora_B`` (out x r), served as W = W0 + scale * B A over the base model
    whose bf16 state digest is ``base_digest`` (weights/adapters.py). ``base``: where that base lies in the object store
    when nodes cannot build it from the recipe (a warm start trained every weight); None: every node's model is it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    base_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    scale: float = Field(gt=0, allow_inf_nan=False)  # lora alpha / rank
    base: ObjectRef | None = None


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
    suspects: list[Suspect] = []  # of the batches trained: the trajectories the token check left out (the dataflow blames their nodes)
    lineage: str = ""  # the weight lineage this version belongs to (a trainer that starts over makes a new one)
    adapter: AdapterSpec | None = None  # a LoRA version: the state is adapters over a base model; None: the full weights
    created_at: float = Field(default_factory=time.time)


class _Stats(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def summary(self) -> dict[str, float]:
        """The headline figures, for dashboards (``status``, the live view of ``up``)."""
        return {k: float(v) for k, v in self.model_dump().items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


TOOL_COUNTS = ("tool_calls", "tool_call_parse_failures")
"""A node's ``counters`` of agents' tool use, summed from its trajectories' ``meta`` once its workflow reports them."""


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
    warm_start_steps: int = Field(0, ge=0)  # during the SFT warm start before v0: its steps (0: none running)
    warm_start_done: int = Field(0, ge=0)  # and how many are done

    def summary(self) -> dict[str, float]:
        return {**self.step, "wait_frac": self.wait_frac, "wait_s": self.wait_s}


class DataflowStats(_Stats):
    """The dataflow's regulation at a glance. Read by the launcher and ``status``."""

    role: Literal["dataflow"] = "dataflow"
    issued: int = 0
    samples: int = 0  # trajectories of the groups that completed into the dataflow, every policy (durable: survives restarts)
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
    reason: str  # for people: what was wrong, with the values
    worker_id: str
    headers: dict[str, str] = {}
    payload: bytes  # the original bytes, untouched
    code: str = ""  # for programs: a batch's ``BatchRefusal``, a trajectory's check that failed; "" when it did not decode
    ts: float = Field(default_factory=time.time)


class BatchRefusal(str, Enum):
    """Why a trainer turned a batch away, in ``Rejected.code``. The dataflow acts on it: ``STALE`` -> its tasks are
    ``dropped:stale``; ``FORGED`` (another content under a planned id: the planned batch may still come) -> no fate;
    anything else -> ``failed:train``."""

    STALE = "stale"
    FORGED = "forged"
    MISSING = "missing"  # a referenced trajectory (or its arrays in the object store) is gone from the plane
    MISMATCH = "mismatch"  # a referenced sequence holds another trajectory, task or policy than the manifest names
    UNPLANNED = "unplanned"  # no plan record: not a batch the dataflow planned (or its plan is gone)
    INVALID = "invalid"  # values a trainer cannot train (policy, advantages, token ids)
    NON_FINITE = "non_finite"  # the step's loss or gradient norm was not finite: no update was made
    STEP_FAILED = "step_failed"

    @classmethod
    def of(cls, code: str) -> BatchRefusal | None:
        """The refusal ``code`` names; None for a code that is not one."""
        try:
            return cls(code)
        except ValueError:
            return None


@dataclass(frozen=True)
class Refusal:
    """A batch turned away: the typed why and the words for people (dead-lettered as ``Rejected.code`` / ``reason``)."""

    code: BatchRefusal
    detail: str

    @property
    def reason(self) -> str:
        return f"{self.code.value}: {self.detail}"


KINDS: dict[str, type[Message]] = {
    m.kind: m for m in (Task, Trajectory, TrajectoryGroup, TrajectoryBundle, Batch, WeightVersion, Heartbeat, Rejected)
}
HEARTBEAT_PERIOD_S = 2.0
