"""Checkpoint files whose bytes are written with the GIL released, so that a background write does not stall the
trainer's other threads: ``torch.save`` and safetensors' ``save_file`` hold the GIL while they copy, and a thread of
small torch ops ran at 22 % and 43 % of its pace beside them, at 90 % beside a plain write of the same bytes
(BENCHMARKS.md, "The checkpoint writer off the trainer's core").

:func:`write_safetensors` writes the safetensors format, which safetensors' own loaders read:

    u64 n (little-endian) | header: n bytes of JSON, padded with spaces to a multiple of 8 | data

with header = ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` and each
tensor's bytes at [begin, end) of the data, in order, without gaps. Only the header is built under the GIL; the
tensors' memory goes out through ``os.writev``, all of it in one call (:func:`write_all`).

:func:`write_state` and :func:`read_state` hold a nested state (an optimizer's ``state_dict``: dicts with int or str
keys, lists, tuples, numbers, strings, None and tensors) as such a file: its tensors, and its structure as JSON in the
metadata (key ``state``), each tensor named where it stood.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64",
          torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
STATE_KEY = "state"
# buffers one writev takes (POSIX guarantees 16; Linux says 1024)
IOV_MAX = max(16, os.sysconf("SC_IOV_MAX")) if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 16


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path | str, metadata: Mapping[str, str] | None = None) -> None:
    """``tensors`` (on the CPU) as a safetensors file at ``path``; a dtype safetensors has no name for raises ValueError."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    views, offset = [], 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: {t.dtype} has no safetensors dtype")
        if t.device.type != "cpu":
            raise ValueError(f"tensor {name!r} is on {t.device}: copy it to the CPU first")
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()  # the tensor's own memory
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + data.size]}
        views.append(data.data)
        offset += data.size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, [struct.pack("<Q", len(text)) + text, *views])
    finally:
        os.close(fd)


def write_all(fd: int, buffers: list[bytes | memoryview]) -> None:
    """``buffers`` one after the other, in as few system calls as the kernel takes (``os.writev``: up to ``IOV_MAX``
    buffers a call). Each call releases the GIL once for all its bytes; a call per tensor would take it back after
    each, and every hand-over of the GIL between the writer and the step's thread costs the step a wake-up."""
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    if not hasattr(os, "writev"):  # not on this platform: one at a time
        for view in pending:
            while view:
                view = view[os.write(fd, view):]
        return
    while pending:
        n = os.writev(fd, pending[:IOV_MAX])  # it may write less than asked
        done = 0
        while done < len(pending) and n >= len(pending[done]):
            n -= len(pending[done])
            done += 1
        del pending[:done]
        if n:
            pending[0] = pending[0][n:]


def write_state(state: Any, path: Path | str) -> None:
    """A nested state with CPU tensors (an optimizer's ``state_dict``) as a safetensors file (:func:`read_state`)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, "", tensors)
    write_safetensors(tensors, path, {STATE_KEY: json.dumps(skeleton)})


def read_state(path: Path | str, device: str | torch.device = "cpu") -> Any:
    """What :func:`write_state` wrote, its tensors on ``device``."""
    with safe_open(str(path), framework="pt", device=str(device)) as f:  # one open: the metadata, then the tensors
        meta = f.metadata() or {}
        if STATE_KEY not in meta:
            raise ValueError(f"{path}: no {STATE_KEY!r} in its metadata: not written by write_state")
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safetensors handle: no iteration)
    return _rebuild(json.loads(meta[STATE_KEY]), tensors)


def _flatten(node: Any, where: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON skeleton of ``node``; its tensors into ``tensors``, named by their path (``state.3.exp_avg``)."""
    if isinstance(node, torch.Tensor):
        if where in tensors:
            raise ValueError(f"two tensors of the state are named {where!r}")
        tensors[where] = node
        return {"tensor": where}
    if isinstance(node, dict):
        for k in node:
            if not isinstance(k, (int, str)) or isinstance(k, bool):
                raise TypeError(f"{where or 'the state'}: a key of type {type(k).__name__}")
        return {"dict": [[k, _flatten(v, f"{where}.{k}" if where else str(k), tensors)] for k, v in node.items()]}
    if isinstance(node, (list, tuple)):
        items = [_flatten(v, f"{where}.{i}" if where else str(i), tensors) for i, v in enumerate(node)]
        return {"tuple" if isinstance(node, tuple) else "list": items}
    if node is None or isinstance(node, (bool, int, float, str)):
        return {"value": node}
    raise TypeError(f"{where or 'the state'}: cannot store a {type(node).__name__}")


def _rebuild(node: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    (kind, body), = node.items()
    if kind == "tensor":
        return tensors[body]
    if kind == "dict":
        return {k: _rebuild(v, tensors) for k, v in body}
    if kind in ("list", "tuple"):
        items = [_rebuild(v, tensors) for v in body]
        return tuple(items) if kind == "tuple" else items
    if kind == "value":
        return body
    raise ValueError(f"unknown node {kind!r} in a stored state")
