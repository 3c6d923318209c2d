"""How fast a trainer gets a batch's trajectories: the manifest's batched fetch against raw reads of the same bytes.

A batch of 512 trajectories of 8,192 completion tokens (64 groups of 8; 16 prompt tokens; random
byte-range token ids, random logprobs) is published on one embedded nats-server (8 MiB
``max_payload``), then read back, each way best of ``--rounds``, in the same process:

- **raw ordered consumer**: an ordered push consumer from the batch's first sequence, bytes only,
  no decoding: the server's own streaming speed for these messages (the baseline);
- **raw direct gets**: ``streams/direct.py`` alone (``read_seqs``), bytes only: the transport the
  trainer uses;
- **trainer fetch**: ``streams/trajectories.fetch_trajectories``, what the trainer runs: batched
  direct gets, decoding into ``Trajectory`` messages (zstd, msgpack, pydantic) on a thread, and
  resolving any offloaded arrays;
- **one request per trajectory**: ``STREAM.MSG.GET`` per sequence, the way trajectories were read
  back before (the dataflow's replay), for scale;
- **decoding alone**: the trainer fetch's decoding of the same bytes, already in memory, to tell
  the transport's share from the decoding's.

The batch's trajectories lie either contiguous in the stream (one node published them) or
interleaved with as many that the batch does not name (other groups: filtered, or of other
batches), which cuts the manifest into runs of one group (8 consecutive sequences).
Run: ``python benchmarks/bench_batch_fetch.py [--rounds 5] [--tokens 8192]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable

import numpy as np
from nats.js import api
from rich.console import Console
from rich.table import Table

from astraflow.streams.codec import decode
from astraflow.streams.direct import read_seqs
from astraflow.streams.messages import Batch, Trajectory, TrajRef
from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.server import EmbeddedServer
from astraflow.streams.trajectories import fetch_trajectories, publish_trajectories

GROUPS, GROUP = 64, 8


def trajectory(task: int, i: int, tokens: int, rng: np.random.Generator) -> Trajectory:
    return Trajectory(traj_id=f"t{task:08d}.solver.{i}", task_id=f"t{task:08d}", prompt_id="p", policy="solver", index=i,
                      group_size=GROUP, prompt_ids=rng.integers(3, 259, 16, dtype="<i4"),
                      completion_ids=rng.integers(3, 259, tokens, dtype="<i4"),
                      logprobs=-rng.exponential(2.0, tokens).astype("<f4"), versions=np.zeros(tokens, "<i4"),
                      loss_mask=np.ones(tokens, "<u1"), reward=float(i % 2))


async def publish(plane: Plane, tokens: int, interleaved: bool, rng: np.random.Generator) -> Batch:
    """Publish the batch's 64 groups (with as many other groups between them when ``interleaved``); its manifest."""
    refs: list[TrajRef] = []
    for g in range(GROUPS):
        named = [trajectory(2 * g, i, tokens, rng) for i in range(GROUP)]
        seqs = await publish_trajectories(plane, named)
        refs += [TrajRef(seq=s, traj_id=t.traj_id, task_id=t.task_id) for s, t in zip(seqs, named, strict=True)]
        if interleaved:
            await publish_trajectories(plane, [trajectory(2 * g + 1, i, tokens, rng) for i in range(GROUP)])
    return Batch(batch_id="solver-b000001", policy="solver", refs=refs, advantages=np.zeros(len(refs), "<f4"),
                 task_ids=sorted({r.task_id for r in refs}))


async def raw_ordered(plane: Plane, batch: Batch) -> int:
    """Bytes of the batch's messages through an ordered push consumer from its first sequence (no decoding)."""
    seqs = [r.seq for r in batch.refs]
    first, last = min(seqs), max(seqs)
    total, done = 0, asyncio.Event()

    async def on_msg(msg: object) -> None:
        nonlocal total
        seq = msg.metadata.sequence.stream  # type: ignore[attr-defined]
        if seq <= last:  # what arrives after the last one before the unsubscription is not the batch's
            total += len(msg.data)  # type: ignore[attr-defined]
        if seq >= last:
            done.set()

    config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first)
    sub = await plane._js.subscribe(plane.names.traj("solver"), stream=plane.names.traj_stream, ordered_consumer=True, config=config,
                                    cb=on_msg, pending_bytes_limit=1 << 30)
    await asyncio.wait_for(done.wait(), 120)
    await sub.unsubscribe()
    return total


async def raw_direct(plane: Plane, batch: Batch) -> int:
    got = await read_seqs(plane._nc, "$JS.API", plane.names.traj_stream, [r.seq for r in batch.refs])
    return sum(len(m.data) for m in got.values())


async def per_message(plane: Plane, batch: Batch) -> int:
    total = 0
    for r in batch.refs:
        total += len((await plane._jsm.get_msg(plane.names.traj_stream, r.seq)).data or b"")
    return total


async def decode_only(raw: list[bytes]) -> list[Trajectory]:
    return await asyncio.to_thread(lambda: [decode(b, Trajectory) for b in raw])


async def best(fn: Callable[[], Awaitable[object]], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return min(times)


async def main(rounds: int, tokens: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    out: dict[str, float] = {"trajectories": GROUPS * GROUP, "completion_tokens": tokens}
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(d) as server:
        plane = await Plane.connect(NatsOptions(url=server.url), "bench", "trainer")
        await plane.ensure_topology(Topology(policies=("solver",)))
        contiguous = await publish(plane, tokens, False, rng)
        interleaved = await publish(plane, tokens, True, rng)
        nbytes = await raw_direct(plane, contiguous)
        ordered = await raw_ordered(plane, contiguous)
        assert ordered == nbytes, (ordered, nbytes)
        fetched = await fetch_trajectories(plane, contiguous)
        assert [t.traj_id for t in fetched] == [r.traj_id for r in contiguous.refs]
        out["encoded_mb"] = round(nbytes / 1e6, 2)
        out["raw_arrays_mb"] = round(sum(sum(len(getattr(t, k)) for k in ("prompt_ids", "completion_ids", "logprobs", "versions",
                                                                         "loss_mask")) for t in fetched) / 1e6, 2)
        raw = [m.data for m in (await read_seqs(plane._nc, "$JS.API", plane.names.traj_stream, [r.seq for r in contiguous.refs])).values()]
        ways = {"raw_ordered_consumer": lambda: raw_ordered(plane, contiguous), "raw_direct_gets": lambda: raw_direct(plane, contiguous),
                "trainer_fetch": lambda: fetch_trajectories(plane, contiguous),
                "trainer_fetch_interleaved": lambda: fetch_trajectories(plane, interleaved),
                "one_request_per_trajectory": lambda: per_message(plane, contiguous), "decoding_alone": lambda: decode_only(raw)}
        for name, fn in ways.items():
            out[f"{name}_s"] = round(await best(fn, rounds), 3)
        await plane.close()
    table = Table(title=f"a batch's trajectories to the trainer: {GROUPS * GROUP} x {tokens:,} tokens, {out['encoded_mb']} MB encoded "
                        f"({out['raw_arrays_mb']} MB of arrays), best of {rounds}")
    for col in ("read", "seconds", "MB/s (encoded)", "trajectories/s", "vs raw ordered consumer"):
        table.add_column(col, justify="left" if col == "read" else "right")
    base = out["raw_ordered_consumer_s"]
    for name in ways:
        s = out[f"{name}_s"]
        out[f"{name}_mb_per_s"] = round(out["encoded_mb"] / s, 1)
        table.add_row(name.replace("_", " "), f"{s:.3f}", f"{out['encoded_mb'] / s:,.0f}", f"{GROUPS * GROUP / s:,.0f}", f"{base / s:.2f}x")
    out["trainer_fetch_vs_raw"] = round(base / out["trainer_fetch_s"], 3)
    Console().print(table)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8192)
    a = ap.parse_args()
    print(json.dumps(asyncio.run(main(a.rounds, a.tokens))))
