"""The shared Prometheus helper: gauges and counters from dicts, served on a free port."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from astraflow.metrics import Metrics, metric_name, start_metrics_server


def test_scrape_shows_gauges_and_counters_with_labels():
    registry = CollectorRegistry()
    port = start_metrics_server(0, registry=registry, addr="127.0.0.1")
    assert port > 0
    m = Metrics("trainer", policy="solver", worker="trainer-solver", registry=registry)
    m.set({"loss": -0.25, "grad_norm": 1.5, "m2po/masked frac": 0.1})
    m.set({"loss": 0.5})
    m.inc({"wait_seconds": 2.0})
    m.inc({"wait_seconds": 0.5})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    labels = '{policy="solver",worker="trainer-solver"}'
    assert f"astraflow_trainer_loss{labels} 0.5" in text
    assert f"astraflow_trainer_grad_norm{labels} 1.5" in text
    assert f"astraflow_trainer_m2po_masked_frac{labels} 0.1" in text
    assert f"astraflow_trainer_wait_seconds_total{labels} 2.5" in text
    with pytest.raises(ValueError):
        m.inc({"wait_seconds": -1.0})
    assert metric_name("rollout", "tokens/s") == "astraflow_rollout_tokens_s"
