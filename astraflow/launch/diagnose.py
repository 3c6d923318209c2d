"""Why a run is not finishing: what every live worker last reported, the plane's backlogs and the last warnings in
each role's log, as a few lines for the message of a run that timed out (a stalled run in CI explains itself)."""

from __future__ import annotations

from pathlib import Path

from astraflow.launch.watcher import Live
from astraflow.streams.messages import Heartbeat

FIGURES = 10  # per worker, the nonzero figures shown
WARNINGS = 3  # per role, the last warnings shown
WIDTH = 220  # characters per warning line


def figures(hb: Heartbeat) -> str:
    """A worker's nonzero headline figures and counters, compact."""
    stats = hb.stats
    values = {**stats.summary(), **getattr(stats, "counters", {})}
    for policy, sync in getattr(stats, "weights", {}).items():  # a node's weight sync, per policy
        values.update({f"{policy}.{k}": v for k, v in sync.items()})
    shown = [f"{k}={v:.4g}" for k, v in values.items() if v][:FIGURES]
    return " ".join(shown) or "-"


def warnings_in(log: Path, n: int = WARNINGS) -> list[str]:
    """The last ``n`` warning, error or traceback lines of a role's log (none if it has no log)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    hits = [line for line in lines if " WARNING " in line or " ERROR " in line or line.startswith("Traceback")]
    return [h[:WIDTH] for h in hits[-n:]]


def stall_report(live: Live, logs: dict[str, Path]) -> str:
    """The plane's backlogs, each live worker's version and figures, each role's last warnings (``logs``: role -> log)."""
    lines = ["backlogs: " + (" ".join(f"{k}={v}" for k, v in live.lags.items()) or "-")]
    for worker, hb in sorted(live.alive().items()):
        lines.append(f"{worker} ({hb.stats.role}, {hb.state}) v{hb.version}: {figures(hb)}")
    for role, log in logs.items():
        lines += [f"{role} log: {w}" for w in warnings_in(log)]
    return "\n".join(lines)
