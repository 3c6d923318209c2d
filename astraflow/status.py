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
    dataflow = await plane.state_get("dataflow", {}) or {}
    accounting = dataflow.get("accounting", {})  # per policy: states that add up to the tasks issued
    autoscale = await plane.state_get(f"autoscale.{dataflow.get('pool', 'raas')}")
    await asyncio.sleep(listen)
    await plane.close()
    return {"streams": streams, "lags": lags, "version": version, "accounting": accounting, "autoscale": autoscale,
            "mode": dataflow.get("mode"), "workers": beats}


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
    for p, acc in info["accounting"].items():
        console.print(accounting_table(p, acc))
    auto = info["autoscale"]
    if auto:
        console.print(f"[bold]autoscale[/] pool {auto['pool']}: {auto['nodes']} live nodes -> target [bold]{auto['target']}[/] "
                      f"({auto['action']}: {auto['reason']}; produce {auto['produce_rate']:.2f} groups/s, "
                      f"consume {auto['consume_rate']:.2f} groups/s, nodes busy {auto['busy']:.0%})")


def accounting_table(policy: str, acc: dict[str, Any]) -> Table:
    """Every task's fate for one policy; the rows add up to the tasks issued (or groups received)."""
    total = "issued" if "issued" in acc else "received"
    a = Table(title=f"task accounting · {policy}")
    a.add_column("state / fate")
    a.add_column("tasks", justify="right")
    rows = [("in flight", acc.get("in_flight", 0))] if total == "issued" else []
    rows += [("buffered", acc.get("buffered", 0)), ("awaiting training", acc.get("awaiting", 0)), *sorted(acc.get("fates", {}).items())]
    for name, n in rows:
        a.add_row(name, str(n))
    a.add_row(f"[bold]{total}[/]", f"[bold]{acc.get(total, 0)}[/]")
    a.caption = ("adds up" if acc.get("adds_up") else "[red]does not add up[/]") + "".join(
        f" · late {k}: {v}" for k, v in acc.get("late", {}).items()) + "".join(f" · skipped {k}: {v}" for k, v in acc.get("skipped", {}).items())
    return a
