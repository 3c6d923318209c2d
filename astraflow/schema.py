"""JSON Schema of the wire contract, exported from the pydantic message models.

``python -m astraflow.schema`` writes ``schemas/*.json`` (one file per message kind,
plus ``envelope.json``); ``--check`` exits 1 if the committed files differ from the models (a
test runs it). Any runtime that speaks this contract can join a run: see ``examples/node/``
and ``schemas/README.md``.

On the wire a message is one flag byte (``0x01`` msgpack, ``0x02`` zstd-compressed msgpack,
used above 16 KiB) followed by the msgpack map ``{"k": kind, "d": fields}``. The schemas
describe ``d`` in its **JSON mapping** (:func:`json_mapping`): msgpack maps, arrays, strings,
integers, floats, booleans and nil are their JSON namesakes, and a msgpack ``bin`` is a
standard base64 string (RFC 4648, padded). So a stock JSON Schema validator checks a decoded
message once its ``bin`` values are base64-encoded. Per-token arrays are ``bin`` of packed
little-endian values: their schema says ``contentEncoding: base64``, a ``pattern`` admitting
only a whole number of items, and ``x-astraflow-packed`` (dtype, item size, what the array is
aligned with). What JSON Schema cannot say (arrays of equal length, the run's policies) is
listed in ``x-astraflow-rules``; Python checks those. Field descriptions come from the
comments in ``astraflow/streams/messages.py`` (who writes a field, who reads it).
"""

from __future__ import annotations

import argparse
import base64
import inspect
import json
import math
import re
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from astraflow.streams import codec
from astraflow.streams.messages import F32, I32, KINDS, SCHEMA_VERSION, U8, Message

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "schemas"
_PACKED = {id(typing.get_args(t)[1]): (name, size) for t, name, size in ((I32, "int32", 4), (F32, "float32", 4), (U8, "uint8", 1))}
_COMMENT = re.compile(r"^\s{4}(\w+):[^#\n]*#\s*(.+)$", re.M)
_B64 = "[A-Za-z0-9+/]"

RULES: dict[str, list[str]] = {
    "trajectory": [
        "completion_ids, logprobs, versions (4 bytes an item) and loss_mask (1 byte an item) hold the same number of items",
        "policy is one of the run's policies (otherwise the dataflow dead-letters it on dlq.traj)",
        "traj_id is '{task_id}.{policy}.{index}' and is the Nats-Msg-Id it is published with (the server deduplicates on it)",
        "versions hold, per completion token, the weight version that produced it (inserted tokens: the version of the turn "
        "before); loss_mask holds 0 or 1",
        "with payload_ref set, the six per-token arrays (routing included) are empty and held by that object in the bucket "
        "af_{run}_traj_objects",
        "routing and routing_layout come together: routing holds whole positions of routing_layout (layers x top_k ids, "
        "1 byte each up to 256 experts, else 2), at most prompt + completion - 1 of them; ids below experts, distinct "
        "within a position's top_k (astraflow/moe_routing.py)",
    ],
    "trajectory_group": [
        "every trajectory has the group's task_id and policy, a distinct traj_id, and no payload_ref (a trajectory too large "
        "for a message travels alone, by reference)",
        "each trajectory obeys the trajectory rules; the dataflow admits, dead-letters (on dlq.traj, encoded alone) and "
        "settles each as if it had come alone",
        "published on af.{run}.traj.{policy} with Nats-Msg-Id '{task_id}.{policy}.group.' + the first 16 hex digits of the "
        "sha256 of its traj_ids joined by newlines; a batch names one of its trajectories by the group's sequence and traj_id",
    ],
    "trajectory_bundle": [
        "every group obeys the trajectory_group rules and has the bundle's policy; no task_id has two groups and no "
        "traj_id appears twice in the bundle",
        "at most 4096 trajectories in all (what one trajectory_group may carry), counted before any is read",
        "the dataflow takes each group as if it had come alone: one with more trajectories than the run's group size is "
        "dead-lettered (on dlq.traj, encoded as a trajectory_group) and the others are taken",
        "published on af.{run}.traj.{policy} with Nats-Msg-Id '{policy}.bundle.' + the first 16 hex digits of the sha256 "
        "of its traj_ids (in order) joined by newlines; a batch names one of its trajectories by the bundle's sequence and "
        "traj_id",
    ],
    "task": ["min_versions maps policies of the run to weight versions; a node holding older weights naks the task (delay 1 s)"],
    "batch": ["advantages holds one float32 per entry of refs; each ref names a trajectory by its sequence in AF_{run}_TRAJ"],
    "weight_version": ["a 'delta' applies onto exactly base_version, whose state digest is base_digest (a node checks both "
                       "before applying it)"],
    "heartbeat": ["stats.role is the worker's role; the subject is af.{run}.hb.{role}.{worker_id}"],
}


def base64_pattern(itemsize: int) -> str:
    """A regex for padded base64 whose decoded length is a multiple of ``itemsize`` bytes.

    Base64 turns every 3 bytes into 4 characters, so a block of lcm(3, itemsize) bytes is a whole
    number of quads; a tail of r = itemsize·j bytes (0 < r < block) is r // 3 quads plus 2 characters
    and '==' (r % 3 == 1) or 3 characters and '=' (r % 3 == 2)."""
    block = math.lcm(3, itemsize)
    tails = []
    for r in range(itemsize, block, itemsize):
        quads, rest = divmod(r, 3)
        tails.append(f"{_B64}{{{4 * quads + rest + 1}}}" + "=" * (3 - rest))  # rest > 0: r < block is no multiple of 3
    tail = f"({'|'.join(tails)})?" if tails else ""
    return f"^({_B64}{{{4 * block // 3}}})*{tail}$"


def json_mapping(value: Any) -> Any:
    """A decoded msgpack value in the JSON mapping the schemas describe: ``bin`` (bytes) as standard base64."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, dict):
        return {k: json_mapping(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_mapping(v) for v in value]
    return value


def _field_comments(model: type[BaseModel]) -> dict[str, str]:
    return {name: text.strip() for name, text in _COMMENT.findall(inspect.getsource(model))}


def _binary(prop: dict[str, Any], packed: tuple[str, int] | None) -> None:
    """A ``bytes`` field in the JSON mapping: base64 of the bin, whole items only when packed."""
    prop.pop("format", None)
    dtype, size = packed or ("bytes", 1)
    prop.update({"contentEncoding": "base64", "contentMediaType": "application/octet-stream", "pattern": base64_pattern(size)})
    if packed:
        prop["x-astraflow-packed"] = {"dtype": dtype, "itemsize": size, "byteorder": "little", "msgpack": "bin"}


def _annotate(model: type[BaseModel], schema: dict[str, Any]) -> None:
    """Descriptions from the source comments; the JSON mapping of bytes fields."""
    comments = _field_comments(model)
    props = schema.get("properties", {})
    for name, info in model.model_fields.items():
        prop = props.get(name)
        if prop is None:
            continue
        if name in comments and "description" not in prop:
            prop["description"] = comments[name]
        if prop.get("format") == "binary":
            _binary(prop, next((_PACKED[id(m)] for m in info.metadata if id(m) in _PACKED), None))


def message_schema(model: type[Message]) -> dict[str, Any]:
    schema = model.model_json_schema(mode="validation")
    _annotate(model, schema)
    for sub_name, sub in schema.get("$defs", {}).items():
        sub_model = getattr(sys.modules[model.__module__], sub_name, None)
        if isinstance(sub_model, type) and issubclass(sub_model, BaseModel):
            _annotate(sub_model, sub)
    rules = {"x-astraflow-rules": RULES[model.kind]} if model.kind in RULES else {}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": f"astraflow/{model.kind}.json",
            "x-astraflow-kind": model.kind, "x-astraflow-schema-version": SCHEMA_VERSION, **rules, **schema}


def envelope_schema() -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "astraflow/envelope.json",
        "title": "Envelope",
        "description": (f"Every message on the plane: one flag byte ({codec.RAW!r} = msgpack, {codec.ZSTD!r} = zstd-compressed "
                        f"msgpack, used when the msgpack body exceeds {codec.COMPRESS_ABOVE} bytes), then this msgpack map. "
                        "'d' must validate against the schema of kind 'k' (in the JSON mapping: msgpack bin as base64); "
                        "'d.v' is the schema version."),
        "type": "object", "additionalProperties": False, "required": ["k", "d"],
        "properties": {"k": {"enum": sorted(KINDS)}, "d": {"type": "object"}},
        "x-astraflow-flags": {"raw": codec.RAW[0], "zstd": codec.ZSTD[0], "compress_above": codec.COMPRESS_ABOVE},
        "x-astraflow-schema-version": SCHEMA_VERSION,
        "x-astraflow-subjects": {
            "task": "af.{run}.task.{workflow} on stream AF_{run}_TASK; rollout nodes pull the durable consumer {pool} (default raas)",
            "trajectory": "af.{run}.traj.{policy} on stream AF_{run}_TRAJ; publish with header Nats-Msg-Id = traj_id",
            "trajectory_group": "af.{run}.traj.{policy} on stream AF_{run}_TRAJ: several samples of one task in one message; "
                                "publish with header Nats-Msg-Id = its group id (see its rules)",
            "trajectory_bundle": "af.{run}.traj.{policy} on stream AF_{run}_TRAJ: the groups of several tasks in one message; "
                                 "publish with header Nats-Msg-Id = its bundle id (see its rules)",
            "weight_version": "af.{run}.weights.{policy} on stream AF_{run}_WEIGHTS (Limits; follow it, never pull a durable)",
            "heartbeat": "af.{run}.hb.{role}.{worker_id}, core NATS, every 2 s",
            "rejected": "af.{run}.dlq.{family} on stream AF_{run}_DLQ: family is the subject family of the rejected message "
                        "(task, traj, batch, weights)",
        },
    }


def render() -> dict[str, str]:
    """File name -> JSON text for every schema."""
    files = {"envelope.json": envelope_schema()}
    for kind, model in sorted(KINDS.items()):
        files[f"{kind}.json"] = message_schema(model)
    return {name: json.dumps(body, indent=2, sort_keys=False) + "\n" for name, body in files.items()}


def stale(out: Path) -> list[str]:
    """Files under ``out`` that are missing or differ from the models."""
    return [name for name, text in render().items() if not (out / name).exists() or (out / name).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Export the wire contract as JSON Schema.")
    ap.add_argument("--out", type=Path, default=DEFAULT_DIR, help="directory (default: the repository's schemas/)")
    ap.add_argument("--check", action="store_true", help="exit 1 if the files are not up to date; write nothing")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale(args.out)
        if bad:
            print(f"out of date in {args.out}: {', '.join(bad)} — run `python -m astraflow.schema`", file=sys.stderr)
            return 1
        print(f"{args.out}: up to date")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (args.out / name).write_text(text)
    print(f"wrote {len(render())} schemas to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
