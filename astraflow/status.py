"""``astraflow status``: what a live run looks like from the plane alone."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from astraflow.streams.census import backlogs, stream_sizes
from astraflow.streams.dataflow_state import Accounting, DataflowState, Quarantine
from astraflow.streams.messages import HEARTBEAT_PERIOD_S, Heartbeat
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.state import AutoscaleRecord, VersionRecord

STALE_BEATS = 3


class NoSuchRun(LookupError):
    """The server answers, but holds no run by that id."""


async def collect(opts: NatsOptions, run: str, policy: str | None = None, listen: float = 2.5, timeout: float = 5.0) -> dict[str, Any]:
    """Everything ``status`` shows, read from the plane; raises ConnectionError after ``timeout`` without a
    server, :class:`NoSuchRun` when the run's streams are not there."""
    plane = await Plane.connect(opts, run, "status", wait=timeout)
    try:
        streams = await stream_sizes(plane)
        if all(n is None for n in streams.values()):
            raise NoSuchRun(f"no run {run!r} on {opts.redacted()} (none of its streams exist)")
        received: dict[str, tuple[Heartbeat, float]] = {}

        def on_beat(hb: Heartbeat) -> None:
            received[hb.worker_id] = (hb, time.time())

        await plane.on_heartbeats(on_beat)
        dataflow = await plane.state.get(DataflowState)
        policies = list(dataflow.lanes) if dataflow else []
        policy = policy or (policies[0] if policies else "solver")
        pulls = await backlogs(plane, dataflow.pool if dataflow else "raas", policies or [policy])
        lags = {label: lag.__dict__ if lag else None for label, lag in pulls.items()}
        version = await plane.state.get(VersionRecord, policy)
        autoscale = await plane.state.get(AutoscaleRecord, dataflow.pool if dataflow else "raas")
        await asyncio.sleep(listen)
    finally:
        await plane.close()
    return {"streams": streams, "lags": lags, "policy": policy, "version": version.version if version else None,
            "accounting": dataflow.accounting if dataflow else {}, "autoscale": autoscale, "mode": dataflow.mode if dataflow else None,
            "workers": received, "quarantined": dataflow.quarantined if dataflow else {}}


async def show(opts: NatsOptions, run: str, policy: str | None = None, timeout: float = 5.0) -> None:
    info = await collect(opts, run, policy, timeout=timeout)
    console = Console()
    console.print(f"[bold]run {run}[/] · policy {info['policy']} at version {info['version']}")
    t = Table(title="streams and lag")
    for c in ("stream / consumer", "messages / pending", "ack pending", "redelivered"):
        t.add_column(c)
    for s, n in info["streams"].items():
        t.add_row(s, "—" if n is None else str(n), "", "")
    for label, lag in info["lags"].items():
        t.add_row(label, *(str(lag[k]) if lag else "—" for k in ("pending", "ack_pending", "redelivered")))
    console.print(t)
    w = Table(title="workers (heartbeats)")
    for c in ("worker", "role", "pool", "region", "version", "state", "stats"):
        w.add_column(c)
    now = time.time()
    for wid, (hb, _) in sorted(info["workers"].items()):
        age = now - hb.ts
        stats = " ".join(f"{k}={v:.3g}" for k, v in list(hb.stats.summary().items())[:8])
        state = hb.state
        if age > STALE_BEATS * HEARTBEAT_PERIOD_S:  # its last beat is old: a worker that died just now
            state, stats = f"[red]gone {age:.0f}s[/]", f"[dim]stale: {stats}[/]"
        w.add_row(wid, hb.role, hb.pool, hb.region, str(hb.version), state, stats)
    if not info["workers"]:
        w.caption = "no heartbeat in the last few seconds: no live worker"
    console.print(w)
    for p, acc in info["accounting"].items():
        console.print(accounting_table(p, acc))
    if info["quarantined"]:
        console.print(quarantine_table(info["quarantined"]))
    auto: AutoscaleRecord | None = info["autoscale"]
    if auto:
        console.print(f"[bold]autoscale[/] pool {auto.pool}: {auto.nodes} live nodes -> target [bold]{auto.target}[/] "
                      f"({auto.action}: {auto.reason}; produce {auto.produce_rate:.2f} groups/s, "
                      f"consume {auto.consume_rate:.2f} groups/s, nodes busy {auto.busy:.0%})")


def quarantine_table(quarantined: dict[str, Quarantine]) -> Table:
    """The nodes the dataflow cut off: since when, their failed tasks by check, the refusal that tipped them over."""
    q = Table(title="quarantined nodes (their trajectories refused, their credential revoked)")
    for c in ("node", "since", "failed tasks", "last refusal"):
        q.add_column(c)
    for node, entry in sorted(quarantined.items()):
        q.add_row(node, time.strftime("%H:%M:%S", time.localtime(entry.at)), entry.summary(), entry.reason[:120])
    q.caption = "let one back in: astraflow node admit NAME --run-dir RUN"
    return q


def accounting_table(policy: str, acc: Accounting) -> Table:
    """Every task's fate for one policy; the rows add up to the tasks issued (or groups received)."""
    a = Table(title=f"task accounting · {policy}")
    a.add_column("state / fate")
    a.add_column("tasks", justify="right")
    rows: list[tuple[str, int]] = [("in flight", acc.in_flight)] if acc.basis == "issued" else []
    rows += [("buffered", acc.buffered), ("awaiting training", acc.awaiting), *sorted(acc.fates.items())]
    for name, n in rows:
        a.add_row(name, str(n))
    a.add_row(f"[bold]{acc.basis}[/]", f"[bold]{acc.total}[/]")
    a.caption = ("adds up" if acc.adds_up else "[red]does not add up[/]") + "".join(
        f" · late {k}: {v}" for k, v in acc.late.items()) + "".join(f" · skipped {k}: {v}" for k, v in acc.skipped.items())
    return a
