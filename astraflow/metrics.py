"""Prometheus export shared by the roles: a scrape endpoint and gauges / counters set from dicts.

A role builds ``Metrics("trainer", policy="solver", worker="trainer-solver")`` and calls
``set({...})`` / ``inc({...})`` with plain floats; each key becomes the metric
``astraflow_{role}_{key}`` (counters get ``_total``) labelled with ``policy`` and ``worker``.
``start_metrics_server(0)`` picks a free port and returns it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, start_http_server

_BAD = re.compile(r"[^a-zA-Z0-9_]")
LABELS = ("policy", "worker")


def metric_name(role: str, key: str) -> str:
    """``astraflow_{role}_{key}`` with every character outside [a-zA-Z0-9_] replaced by ``_``."""
    return _BAD.sub("_", f"astraflow_{role}_{key}")


SERVING: list[str] = []  # HOST:PORT of the endpoint this process serves (heartbeats advertise it)


def start_metrics_server(port: int | None, registry: CollectorRegistry | None = None, addr: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` in a daemon thread on ``port`` (0 or None: a free one); returns the port."""
    server, _thread = start_http_server(port or 0, addr=addr, registry=registry or REGISTRY)
    host = "127.0.0.1" if addr in ("0.0.0.0", "127.0.0.1") else addr
    SERVING[:] = [f"{os.environ.get('ASTRAFLOW_METRICS_HOST', host)}:{server.server_port}"]
    return int(server.server_port)


def serving() -> str:
    """Where this process serves its metrics (``""`` when it does not); set ``$ASTRAFLOW_METRICS_HOST`` on a remote machine."""
    return SERVING[0] if SERVING else ""


class Metrics:
    """Gauges and counters of one role, created on first use, labelled with policy and worker."""

    def __init__(self, role: str, policy: str = "", worker: str = "", registry: CollectorRegistry | None = None) -> None:
        self.role = role
        self.labels = {"policy": policy, "worker": worker}
        self.registry = registry or REGISTRY
        self._gauges: dict[str, Gauge] = {}
        self._counters: dict[str, Counter] = {}

    def child(self, policy: str) -> Metrics:
        """The same role, worker and metrics, labelled with another ``policy`` (a node serving several policies)."""
        m = Metrics(self.role, policy=policy, worker=self.labels["worker"], registry=self.registry)
        m._gauges, m._counters = self._gauges, self._counters
        return m

    def set(self, values: Mapping[str, float]) -> None:
        """Set one gauge per key."""
        for key, value in values.items():
            g = self._gauges.get(key)
            if g is None:
                g = self._gauges[key] = Gauge(metric_name(self.role, key), f"{self.role} {key}", LABELS, registry=self.registry)
            g.labels(**self.labels).set(float(value))

    def inc(self, values: Mapping[str, float]) -> None:
        """Add to one counter per key (exported as ``..._total``); amounts must be >= 0."""
        for key, amount in values.items():
            c = self._counters.get(key)
            if c is None:
                c = self._counters[key] = Counter(metric_name(self.role, key), f"{self.role} {key}", LABELS, registry=self.registry)
            c.labels(**self.labels).inc(float(amount))
