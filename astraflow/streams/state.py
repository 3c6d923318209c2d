"""Run state: frozen, schema-versioned records in the run's KV buckets, each with its key builder.

The plane carries two kinds of things: messages on subjects (``messages.py``) and the run's
state in a KV bucket (this module). Both are typed the same way: a frozen pydantic model with a
schema version, one module owning the names. A record knows its key (``record.key``), and the
key of a record that is not in hand is built from the same parts (``VersionRecord.key_for(p)``),
so no key is ever an f-string elsewhere.

Values are JSON text (``{"v": 1, ...}``), so operators read them with ``nats kv get``.

Reads tell "absent" from "failed": :meth:`RunState.get` returns None for a key never written
(or deleted) and raises :class:`StateReadError` when the server could not answer, and
:class:`StateSchemaError` (a ``StateReadError``) when the value is not a valid record of this
build's schema. A restarting role must never mistake a failed read for a new run.

| key | record | written by | read by |
|---|---|---|---|
| ``version.{policy}`` | :class:`VersionRecord` | trainer, after each announcement | nodes, evaluator, dataflow |
| ``done.{policy}`` | :class:`DoneRecord` | trainer, at its last step | launcher, benchmarks |
| ``eval.{policy}.{version}`` | :class:`EvalRecord` | evaluator | launcher |
| ``autoscale.{pool}`` | :class:`AutoscaleRecord` | dataflow | launcher, ``status`` |
| ``keyframe_request.{policy}`` | :class:`KeyframeRequest` | nodes, operators | trainer |
| ``admit.{node}`` | :class:`AdmitRecord` | operators (``astraflow node admit``) | dataflow |
| ``dataflow`` | ``DataflowState`` (``dataflow_state.py``) | dataflow | dataflow, ``status`` |
| ``fate.{policy}.{task_id}`` | :class:`FateRecord`, fates bucket with a TTL | dataflow | operators, tests |
| ``plan.{policy}.{batch_id}`` | :class:`BatchPlanRecord`, fates bucket with a TTL | dataflow | trainer |
"""

from __future__ import annotations

import json
import time
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from astraflow.streams.subjects import check_token

STATE_SCHEMA_VERSION = 1
R = TypeVar("R", bound="Record")


class StateReadError(RuntimeError):
    """The run state could not be read (server error, timeout): never treat it as "absent"."""


class StateSchemaError(StateReadError):
    """A stored value is not a valid record of this build's schema (another version, or garbage)."""


class Record(BaseModel):
    """A value in the run state. ``family`` is the first token of its key; ``parts`` name the rest."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    family: ClassVar[str]
    parts: ClassVar[tuple[str, ...]] = ()  # fields whose values complete the key, in order
    fates: ClassVar[bool] = False  # lives in the fates bucket (bounded by a TTL), not the state bucket
    v: int = STATE_SCHEMA_VERSION  # schema version, checked on read (an int: never a string, float or boolean)
    ts: float = Field(default_factory=time.time)

    @classmethod
    def key_for(cls, *parts: str | int) -> str:
        if len(parts) != len(cls.parts):
            raise TypeError(f"{cls.__name__} keys take {len(cls.parts)} parts ({', '.join(cls.parts)}), got {len(parts)}")
        return ".".join([cls.family, *(check_token(name, str(p)) for name, p in zip(cls.parts, parts))])

    @property
    def key(self) -> str:
        return self.key_for(*(getattr(self, p) for p in self.parts))

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls: type[R], key: str, data: bytes) -> R:
        """``data`` as a ``cls``; StateSchemaError when it is not one. Parsed and validated in one strict pass by
        pydantic's JSON parser (a 15-KB dataflow state: 0.4 ms, against 2.0 ms through ``json.loads``, which the launcher
        paid several times a second); anything that pass refuses, or whose schema version is absent or another, goes
        through :meth:`_decode_with_reasons`, which names the reason (and reads a value of a looser type, a number
        written as a string, as it always did)."""
        try:  # strict: every value of the type its field declares, as this build writes it (anything else: the slow path)
            record = cls.model_validate_json(data, strict=True)
        except ValidationError:
            return cls._decode_with_reasons(key, data)
        if "v" not in record.model_fields_set or record.v != STATE_SCHEMA_VERSION:
            return cls._decode_with_reasons(key, data)
        return record

    @classmethod
    def _decode_with_reasons(cls: type[R], key: str, data: bytes) -> R:
        """The checks of :meth:`decode` one by one, each with its own reason: JSON, an object, the schema version (an int),
        then the fields, validated as they always were (a number written as a string is read as the number)."""
        try:
            obj = json.loads(data)
        except ValueError as e:
            raise StateSchemaError(f"{key}: not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise StateSchemaError(f"{key}: not a record: {str(obj)[:80]}")
        if obj.get("v") != STATE_SCHEMA_VERSION or type(obj.get("v")) is not int:
            raise StateSchemaError(f"{key}: schema version {obj.get('v')!r}, this build reads {STATE_SCHEMA_VERSION}")
        try:
            return cls.model_validate(obj)
        except ValidationError as e:
            raise StateSchemaError(f"{key}: invalid {cls.__name__}: {e.errors(include_url=False)}") from None


class VersionRecord(Record):
    """The newest announced version of a policy. Written by its trainer after each announcement."""

    family: ClassVar[str] = "version"
    parts: ClassVar[tuple[str, ...]] = ("policy",)
    policy: str
    version: int = Field(ge=0)
    lineage: str = ""  # the weight lineage (a trainer that starts over makes a new one)


class DoneRecord(Record):
    """A policy's trainer reached its last step. Written by the trainer, read by the launcher."""

    family: ClassVar[str] = "done"
    parts: ClassVar[tuple[str, ...]] = ("policy",)
    policy: str
    version: int = Field(ge=0)


class EvalRecord(Record):
    """Held-out evaluation of one version. Written by the evaluator, read by the launcher."""

    family: ClassVar[str] = "eval"
    parts: ClassVar[tuple[str, ...]] = ("policy", "version")
    policy: str
    version: int = Field(ge=0)
    reward: float = Field(allow_inf_nan=False)  # greedy held-out reward
    avg_at_k: float = Field(0.0, alias="avg@k", allow_inf_nan=False)
    pass_at_k: float = Field(0.0, alias="pass@k", allow_inf_nan=False)
    k: int = Field(1, ge=1)
    n: int = Field(0, ge=0)  # held-out prompts scored
    skipped: str = ""  # why the version could not be evaluated (gone from the history before the evaluator got to it); no figures then
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    def encode(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()


class AutoscaleRecord(Record):
    """The dataflow's advised rollout-pool size. Written by the dataflow, read by ``up --autoscale`` and ``status``."""

    family: ClassVar[str] = "autoscale"
    parts: ClassVar[tuple[str, ...]] = ("pool",)
    pool: str
    target: int = Field(ge=0)
    action: str  # up / down / hold
    reason: str
    need: int | None = None
    nodes: int = Field(ge=0)
    wait_frac: float
    produce_rate: float
    consume_rate: float
    busy: float


class KeyframeRequest(Record):
    """Ask the trainer of ``policy`` for a keyframe. Written by nodes or operators, read by the trainer (its revision)."""

    family: ClassVar[str] = "keyframe_request"
    parts: ClassVar[tuple[str, ...]] = ("policy",)
    policy: str
    by: str
    reason: str = ""


class AdmitRecord(Record):
    """An operator lets a quarantined node back in (``astraflow node admit``): the dataflow lifts the quarantine it
    names, and the launcher restores the node's credential on its server."""

    family: ClassVar[str] = "admit"
    parts: ClassVar[tuple[str, ...]] = ("node",)
    node: str
    by: str = "operator"
    quarantined_at: float | None = None  # the quarantine it lifts (its ``at``, on the dataflow's clock); None: any before ``ts``

    def lifts(self, quarantined_at: float) -> bool:
        """Whether this admission is of the quarantine begun at ``quarantined_at`` (not of an earlier one of the node),
        whatever the writers' clocks."""
        return quarantined_at <= self.quarantined_at if self.quarantined_at is not None else quarantined_at < self.ts


class FateRecord(Record):
    """How one task ended for one policy. Written by the dataflow; kept for ``plane.fate_ttl`` seconds."""

    family: ClassVar[str] = "fate"
    parts: ClassVar[tuple[str, ...]] = ("policy", "task_id")
    fates: ClassVar[bool] = True
    policy: str
    task_id: str
    fate: str  # its ``fates.Fate`` as text: trained / filtered:R / dropped:R / failed:R / invalid:R (none while it waits in
    # a batch: the dataflow's state lists the batch's tasks, and the record comes once the trainer trains or refuses it)
    batch: str | None = None
    version: int | None = None
    error: str | None = None


class BatchPlanRecord(Record):
    """A batch the dataflow planned: its trainer trains a batch only if one exists and ``digest`` matches
    ``Batch.digest()``. Written by the dataflow before it publishes the batch, deleted by it once the
    batch's fate is known (trained or failed); in the fates bucket, so its TTL bounds what is left behind."""

    family: ClassVar[str] = "plan"
    parts: ClassVar[tuple[str, ...]] = ("policy", "batch_id")
    fates: ClassVar[bool] = True
    policy: str
    batch_id: str
    digest: str  # Batch.digest() of the batch as planned
    trajectories: int = Field(ge=0)
