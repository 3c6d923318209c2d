"""Weights end to end at Qwen3-1.7B shape: publish on a hub, mirror to a leaf region, fetch + apply in another process.

The state is bench_weights_scale's (the real names and shapes of Qwen3-1.7B, or ``--preset 100m``;
version k is bf16 of fp32 masters after k AdamW-like steps at ``--lr``). Two real nats-servers
run the shipped ``jetstream/hub.conf`` and ``jetstream/leaf.conf`` (max_payload 8 MB, so 2 MiB
chunks) on loopback; the leaf mirrors the run's weights bucket (``ensure_region_mirrors``). This
process publishes a keyframe v0 and ``--deltas`` deltas into the hub; a second process, connected
only to the leaf, reads the leaf's mirror and applies them, checking the state digest. Two paths,
one after the other in the same run, on the same servers:

* ``whole`` (before this change): encode the whole payload (with the state digest alongside), then
  put it; wait for the mirror; get it whole, then decode or apply it;
* ``stream`` (what ``WeightPublisher`` / ``WeightSync`` do now): the encoder's pieces go to the object
  store as they come (the digest alongside); wait for the mirror; each checked chunk is fed to a
  ``KeyframeDecoder`` / ``DeltaApplier`` as it arrives (``sync.fetch_into``).

Phases, wall seconds: publisher: encode, put (stream: encode + put, overlapped); mirror lag (from
the end of the put until the leaf's mirror holds every chunk; a node starts reading on the
announcement, so in production this overlaps the fetch); receiver: fetch, apply (stream: fetch +
apply, overlapped), digest of the result. End to end is their sum. Peak RSS (VmHWM, reset before
each version) of both processes, the most over the versions of a kind.

    python benchmarks/bench_weights_e2e.py [--preset 1.7b|100m|quick] [--lr 1e-6] [--deltas 2]

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_weights_scale import qwen3_layout, simulate, trim

from astraflow.streams.messages import ObjectRef
from astraflow.streams.objects import ObjectStore, ensure_region_mirrors
from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.server import spawn_kwargs, start_region_pair
from astraflow.weights import delta as codec

try:  # where the tree keeps it
    from astraflow.weights.image import fetch_into
except ImportError:  # a tree from before the held image had a module of its own
    from astraflow.weights.sync import fetch_into  # type: ignore[attr-defined,no-redef]

CONF = Path(__file__).resolve().parent.parent / "jetstream"
PATHS = ("whole", "stream")
_T = TypeVar("_T")


def peak_rss() -> int:
    """Peak resident bytes since the last reset_peak()."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmHWM"].split()[0]) * 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


async def off_loop(fn: Callable[..., _T], *args: Any) -> _T:
    """fn(*args) on a worker thread, its result handed over in a box: an awaited future of asyncio.to_thread keeps
    its result referenced after the await (CPython 3.11), which would keep a freed state resident."""
    box: list[_T] = []
    await asyncio.to_thread(lambda: box.append(fn(*args)))
    return box.pop()


# ------------------------------------------------------------------ publisher (this process)


async def publish(objects: ObjectStore, path: str, version: int, base: dict[str, torch.Tensor] | None,
                  new: dict[str, torch.Tensor]) -> tuple[ObjectRef, str, dict[str, float]]:
    """Put version ``new`` (a delta from ``base``, or a keyframe) by ``path``; (ref, state digest, figures)."""
    trim()
    reset_peak()
    digesting = asyncio.ensure_future(asyncio.to_thread(codec.state_digest, new))  # as the publisher does: alongside

    async def name() -> str:
        return f"e2e/{path}/v{version}-{(await digesting)[:12]}"

    t0 = time.perf_counter()
    out: dict[str, float] = {}
    if path == "whole":
        payload = await off_loop(codec.encode_keyframe, new) if base is None else (await off_loop(codec.encode_delta, base, new))[0]
        await digesting
        out["encode_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        ref = await objects.put(await name(), payload)
        out["put_s"] = time.perf_counter() - t1
        del payload
    else:
        pieces = codec.iter_encode_keyframe(new) if base is None else codec.iter_encode_delta(base, new)
        ref = await objects.put(name(), pieces)
        await digesting
        out["encode_put_s"] = time.perf_counter() - t0
    out["publisher_peak_rss"] = peak_rss()
    return ref, digesting.result(), out


async def main(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    layout = qwen3_layout(args.preset)
    run = "e2e" + uuid.uuid4().hex[:6]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        hub, leaf = start_region_pair(CONF, tmp)
        receiver = None
        try:
            plane = await Plane.connect(NatsOptions(url=hub.url), run, "publisher")
            await plane.ensure_topology(Topology(policies=("solver",)))
            on_leaf = await Plane.connect(NatsOptions(url=leaf.url, domain="hub"), run, "mirrors")
            await on_leaf.wait_for_domain("hub")
            await ensure_region_mirrors(on_leaf, run, hub_domain="hub")
            mirror = on_leaf.objects(domain="leaf")
            receiver = subprocess.Popen([sys.executable, __file__, "--receive", leaf.url, "--run", run], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, **spawn_kwargs())  # type: ignore[call-overload]
            assert receiver.stdin is not None and receiver.stdout is not None
            if json.loads(await asyncio.to_thread(receiver.stdout.readline) or "null") != "ready":  # imported and connected
                raise RuntimeError(f"receiver exited with {receiver.wait()}")
            objects = plane.objects()
            warm = await objects.put("e2e/warm-up", os.urandom(1 << 20))  # the new mirror's first catch-up is not a figure
            while await mirror.chunks(warm) < 1:
                await asyncio.sleep(0.01)
            for path in PATHS:  # one path after the other: each process holds one image (two for a delta) at a time
                new: dict[str, torch.Tensor] | None = None
                for version in range(args.deltas + 1):
                    base, new = new, None  # v-2 goes before v is built: two versions resident at most
                    with console.status(f"{path}: building v{version}"):
                        new = await off_loop(simulate, layout, args.lr, version)
                    with console.status(f"{path}: v{version}"):
                        ref, digest, row = await publish(objects, path, version, base, new)
                        order = {"path": path, "version": version, "ref": ref.model_dump(mode="json"), "digest": digest,
                                 "put_done": time.time()}
                        receiver.stdin.write(json.dumps(order) + "\n")
                        receiver.stdin.flush()
                        answer = await asyncio.to_thread(receiver.stdout.readline)
                        if not answer:
                            raise RuntimeError(f"receiver exited with {receiver.wait()}")
                        row |= json.loads(answer) | {"path": path, "version": version, "bytes": ref.size,
                                                     "encoding": "keyframe" if base is None else "delta"}
                        rows.append(row)
                        console.log(row)
                        await objects.delete(ref)  # keep the disks (and page cache) to one payload
                        await mirror.delete(ref)
                base = new = None
            receiver.stdin.close()
            receiver.wait(60)
            await on_leaf.close()
            await plane.close()
        finally:
            if receiver is not None and receiver.poll() is None:
                receiver.kill()
            leaf.stop()
            hub.stop()
    return summarize(rows, args, sum(math.prod(shape) for _, shape in layout))


# ------------------------------------------------------------------ receiver (the other process)


async def receive(leaf_url: str, run: str) -> None:
    """Answer each order on stdin (a ref to read from the leaf's mirror) with the figures of reading it, on stdout."""
    plane = await Plane.connect(NatsOptions(url=leaf_url, domain="hub"), run, "receiver")
    objects = plane.objects(domain="leaf", wait_missing=120.0)
    images: dict[str, dict[str, torch.Tensor]] = {}
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        order = json.loads(line)
        path, ref = order["path"], ObjectRef.model_validate(order["ref"])
        image = images.pop(path, None) if order["version"] else None
        images.clear()  # one image resident at a time
        trim()
        reset_peak()
        out: dict[str, float] = {}
        while await objects.chunks(ref) < len(ref.digests):
            await asyncio.sleep(0.005)
        out["mirror_lag_s"] = time.time() - order["put_done"]
        t0 = time.perf_counter()
        if path == "whole":
            payload = await objects.get(ref, timeout=60.0)
            out["fetch_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            if image is None:
                image = await off_loop(codec.decode_keyframe, payload)
            else:
                await asyncio.to_thread(codec.apply_delta, image, payload)
            out["apply_s"] = time.perf_counter() - t1
            del payload
        else:
            if image is None:
                image = await fetch_into(objects, ref, codec.KeyframeDecoder())  # type: ignore[assignment]
            else:
                await fetch_into(objects, ref, codec.DeltaApplier(image))
            out["fetch_apply_s"] = time.perf_counter() - t0
        assert image is not None
        t2 = time.perf_counter()
        ok = await asyncio.to_thread(codec.state_digest, image) == order["digest"]
        out["digest_s"] = time.perf_counter() - t2
        out["receiver_peak_rss"] = peak_rss()
        if not ok:
            raise SystemExit(f"{path} v{order['version']}: state digest mismatch")
        images[path] = image
        print(json.dumps(out), flush=True)
    await plane.close()


# ------------------------------------------------------------------ report


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace, params: int) -> dict[str, Any]:
    """Per path and kind: each figure's median over the versions (peaks: the most)."""
    out: dict[str, Any] = {"preset": args.preset, "params": params, "model_bytes": 2 * params, "lr": args.lr, "deltas": args.deltas,
                           "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(), "rows": rows}
    for path in PATHS:
        for kind in ("keyframe", "delta"):
            sel = [r for r in rows if r["path"] == path and r["encoding"] == kind]
            keys = {k for r in sel for k in r if k.endswith("_s") or k == "bytes"}
            fig = {k: statistics.median(r[k] for r in sel) for k in keys}
            fig |= {k: max(r[k] for r in sel) for k in ("publisher_peak_rss", "receiver_peak_rss")}
            fig["end_to_end_s"] = sum(v for k, v in fig.items() if k.endswith("_s"))
            out[f"{path}_{kind}"] = fig
    return out


def render(r: dict[str, Any], console: Console) -> None:
    load = ", ".join(f"{x:.1f}" for x in r["loadavg"])
    t = Table(title=f"weights end to end: {r['params'] / 1e9:.2f} B params ({r['model_bytes'] / 1e9:.2f} GB bf16), lr {r['lr']:g}, "
                    f"hub -> leaf mirror -> other process; {r['cpu_count']} cores (load average {load}); seconds (median of the versions)")
    cols = [(p, k) for k in ("keyframe", "delta") for p in PATHS]
    t.add_column("phase")
    for p, k in cols:
        t.add_column(f"{k}, {p}", justify="right")
    def gib(b: float) -> str:
        return f"{b / 2**30:.2f} GiB"

    for label, key, fmt in (("payload", "bytes", lambda b: f"{b / 1e6:.1f} MB"), ("encode", "encode_s", None), ("put", "put_s", None),
                            ("encode + put (overlapped)", "encode_put_s", None), ("mirror lag", "mirror_lag_s", None),
                            ("fetch", "fetch_s", None), ("apply / decode", "apply_s", None),
                            ("fetch + apply (overlapped)", "fetch_apply_s", None), ("state digest", "digest_s", None),
                            ("end to end", "end_to_end_s", None), ("publisher peak RSS", "publisher_peak_rss", gib),
                            ("receiver peak RSS", "receiver_peak_rss", gib)):
        cells = []
        for p, k in cols:
            v = r[f"{p}_{k}"].get(key)
            cells.append("" if v is None else (fmt(v) if fmt else f"{v:.2f}"))
        t.add_row(label, *cells)
    console.print(t)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=("1.7b", "100m", "quick"), default="1.7b")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--deltas", type=int, default=2)
    ap.add_argument("--receive", metavar="LEAF_URL", help=argparse.SUPPRESS)  # the receiving process
    ap.add_argument("--run", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.receive:
        asyncio.run(receive(a.receive, a.run))
    else:
        con = Console(width=160, stderr=True)
        report = asyncio.run(main(a, con))
        render(report, Console(width=160))
        print(json.dumps(report))
