"""JSON Schema of the wire contract, exported from the pydantic message models.

``python -m astraflow.schema`` writes ``schemas/*.json`` (one file per message kind,
plus ``envelope.json``); ``--check`` exits 1 if the committed files differ from the models (a
test runs it). Any runtime that speaks this contract can join a run: see
``examples/node/`` for one in JavaScript.

On the wire a message is one flag byte (``0x01`` msgpack, ``0x02`` zstd-compressed msgpack,
used above 16 KiB) followed by the msgpack map ``{"k": kind, "d": fields}``. Per-token arrays
are msgpack ``bin`` holding packed little-endian values; in these schemas they are
``{"type": "string", "format": "binary"}`` with ``x-astraflow-packed`` naming the dtype and
what the array is aligned with. Field descriptions come from the comments in
``astraflow/streams/messages.py`` (who writes a field, who reads it).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

from astraflow.streams import codec
from astraflow.streams.messages import F32, I32, KINDS, SCHEMA_VERSION, U8, Message

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "schemas"
_PACKED = {id(typing.get_args(t)[1]): name for t, name in ((I32, "int32"), (F32, "float32"), (U8, "uint8"))}
_COMMENT = re.compile(r"^\s{4}(\w+):[^#\n]*#\s*(.+)$", re.M)


def _field_comments(model: type[Message]) -> dict[str, str]:
    return {name: text.strip() for name, text in _COMMENT.findall(inspect.getsource(model))}


def _annotate(model: type[Message], schema: dict[str, Any]) -> None:
    """Descriptions from the source comments; packed-array markers on bytes fields."""
    comments = _field_comments(model)
    props = schema.get("properties", {})
    for name, info in model.model_fields.items():
        prop = props.get(name)
        if prop is None:
            continue
        if name in comments and "description" not in prop:
            prop["description"] = comments[name]
        for meta in info.metadata:
            if id(meta) in _PACKED:
                prop["x-astraflow-packed"] = {"dtype": _PACKED[id(meta)], "byteorder": "little",
                                              "msgpack": "bin"}
                prop["contentMediaType"] = "application/octet-stream"


def message_schema(model: type[Message]) -> dict[str, Any]:
    schema = model.model_json_schema(mode="validation")
    _annotate(model, schema)
    for sub_name, sub in schema.get("$defs", {}).items():
        sub_model = getattr(sys.modules[model.__module__], sub_name, None)
        if isinstance(sub_model, type) and issubclass(sub_model, Message):
            _annotate(sub_model, sub)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": f"astraflow/{model.kind}.json",
            "x-astraflow-kind": model.kind, "x-astraflow-schema-version": SCHEMA_VERSION, **schema}


def envelope_schema() -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "astraflow/envelope.json",
        "title": "Envelope",
        "description": (f"Every message on the plane: one flag byte ({codec.RAW!r} = msgpack, {codec.ZSTD!r} = zstd-compressed "
                        f"msgpack, used when the msgpack body exceeds {codec.COMPRESS_ABOVE} bytes), then this msgpack map. "
                        "'d' must validate against the schema of kind 'k'; 'd.v' is the schema version."),
        "type": "object", "additionalProperties": False, "required": ["k", "d"],
        "properties": {"k": {"enum": sorted(KINDS)}, "d": {"type": "object"}},
        "x-astraflow-flags": {"raw": codec.RAW[0], "zstd": codec.ZSTD[0], "compress_above": codec.COMPRESS_ABOVE},
        "x-astraflow-schema-version": SCHEMA_VERSION,
        "x-astraflow-subjects": {
            "task": "af.{run}.task.{workflow} on stream AF_{run}_TASK; rollout nodes pull the durable consumer {pool} (default raas)",
            "trajectory": "af.{run}.traj.{policy} on stream AF_{run}_TRAJ; publish with header Nats-Msg-Id = traj_id",
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
