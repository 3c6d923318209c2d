"""``astraflow status``: what a live run looks like from the plane alone."""

from __future__ import annotations

import asyncio
from typing import Any

from rich.console import Console
from rich.table import Table

from astraflow.streams.codec import decode
from astraflow.streams.messages import Heartbeat
from astraflow.streams.plane import NatsOptions, Plane


async def collect(nats: str, run: str, policy: str, listen: float = 2.5) -> dict[str, Any]:
    plane = await Plane.connect(NatsOptions(url=nats), run, "status")
    names = plane.names
    beats: dict[str, Heartbeat] = {}

    async def on_beat(msg: Any) -> None:
        try:
            hb = decode(msg.data, Heartbeat)
            beats[hb.worker_id] = hb
        except ValueError:
            pass

    await plane.nc.subscribe(f"af.{run}.hb.>", cb=on_beat)
    streams = {}
    for s in (names.task_stream, names.traj_stream, names.batch_stream, names.weights_stream, names.dlq_stream):
        try:
            streams[s] = await plane.stream_msgs(s)
        except Exception:
            streams[s] = None
    lags = {}
    for label, stream, durable in (("tasks→raas", names.task_stream, "raas"), ("traj→dataflow", names.traj_stream, names.DATAFLOW_CONSUMER),
                                   (f"batch→trainer-{policy}", names.batch_stream, names.trainer_consumer(policy))):
        try:
            lags[label] = (await plane.lag(stream, durable)).__dict__
        except Exception:
            lags[label] = None
    version = await plane.state_get(f"version.{policy}")
    accounting = ((await plane.state_get("dataflow", {}) or {}).get("lanes", {}).get(policy) or {}).get("ledger", {})
    await asyncio.sleep(listen)
    await plane.close()
    return {"streams": streams, "lags": lags, "version": version, "accounting": accounting, "workers": beats}


async def show(nats: str, run: str, policy: str) -> None:
    info = await collect(nats, run, policy)
    console = Console()
    console.print(f"[bold]run {run}[/] · policy {policy} at version {info['version']}")
    t = Table(title="streams and lag")
    for c in ("stream / consumer", "messages / pending", "ack pending", "redelivered"):
        t.add_column(c)
    for s, n in info["streams"].items():
        t.add_row(s, str(n), "", "")
    for label, lag in info["lags"].items():
        t.add_row(label, *(str(lag[k]) if lag else "—" for k in ("pending", "ack_pending", "redelivered")))
    console.print(t)
    w = Table(title="workers (heartbeats)")
    for c in ("worker", "role", "pool", "region", "version", "state", "stats"):
        w.add_column(c)
    for wid, hb in sorted(info["workers"].items()):
        stats = " ".join(f"{k}={v:.3g}" for k, v in list(hb.stats.items())[:8])
        w.add_row(wid, hb.role, hb.pool, hb.region, str(hb.version), hb.state, stats)
    console.print(w)
    acc = info["accounting"]
    if acc:
        a = Table(title="task accounting")
        a.add_column("fate")
        a.add_column("tasks")
        a.add_row("issued", str(acc.get("issued", 0)))
        for fate, n in sorted(acc.get("fates", {}).items()):
            a.add_row(fate, str(n))
        console.print(a)
