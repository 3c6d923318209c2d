"""The pool model's :class:`~pool_model.Calibration`, read from what the benchmarks measured.

* the dataflow's and the server's CPU, and the plane's messages: ``results/pool_scale.json`` (``bench_pool_scale.py``)
  when it holds at least three points of one server (:func:`plane_measured`); else the recorded "CPU seconds per role"
  table of BENCHMARKS.md, with the message counts as stated assumptions;
* the fan-out: ``results/fanout.json``, time to every node fitted against the copies the hub and the busiest mirror send;
* a cluster of 3's CPU over one server's, and the stall when the member leading the streams is killed:
  ``results/server_chaos.json`` (or ``pool_scale.json``'s cluster3 points, where they exist);
* bytes per changed element and the changed fraction: BENCHMARKS.md's "Weight deltas" section (``bench_delta.py`` writes
  no results file; its figures were recorded by hand).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pool_model import Calibration, copies

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "BENCHMARKS.md"
MIN_POINTS = 3  # points of one topology before pool_scale.json's figures are taken


def fit(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares y ≈ X·c with every c ≥ 0 (a cost is never negative): the best fit over subsets of the columns."""
    x, target = np.asarray(rows, float), np.asarray(y, float)
    best: tuple[float, list[float]] = (math.inf, [0.0] * x.shape[1])
    for k in range(x.shape[1], 0, -1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            c = np.linalg.lstsq(x[:, cols], target, rcond=None)[0]
            resid = float(((x[:, cols] @ c - target) ** 2).sum())
            if (c >= 0).all() and (best[0] == math.inf or resid < best[0] - 1e-12 * (1 + best[0])):
                full = [0.0] * x.shape[1]
                for i, ci in zip(cols, c):
                    full[i] = float(ci)
                best = (resid, full)
    return best[1]


def fit_fanout(runs: Sequence[Mapping[str, Any]]) -> list[float]:
    """to_all = base + hub copies × hub_copy_s + busiest mirror's copies × leaf_copy_s (bench_fanout's runs without relays:
    those are predicted from this fit, not fitted)."""
    flat = [r for r in runs if not r.get("relays")]
    return fit([[1.0, *copies(r["nodes"], r["regions"])] for r in flat], [r["to_all_s"] for r in flat])


def recorded(page: str, heading: str, row: str) -> list[float]:
    """The numbers of a row of a table in a section of BENCHMARKS.md written by hand (no results file behind it)."""
    section = page.split("\n## " + heading, 1)[1].split("\n## ", 1)[0]
    line = next(x for x in section.splitlines() if x.startswith(f"| {row} |"))
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?", line.split("|", 2)[2].replace(",", ""))]


def msgs(p: Mapping[str, Any]) -> float:
    """The server's messages in and out per second, less the copies the load generator's own counter received (it
    subscribes to every JetStream request, ack and heartbeat it counts)."""
    r = p["rates"]
    return float(r["server_msgs_in_per_s"] + r["server_msgs_out_per_s"] - r["js_api_per_s"] - r["acks_per_s"] - r["heartbeats_per_s"])


def plane_measured(points: Sequence[Mapping[str, Any]], where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The dataflow's and the server's costs and the plane's message rates, from bench_pool_scale's points.

    Until the cores are full, trajectories/s grows with the nodes, so a cost per node-second cannot be told apart from
    one per trajectory by fitting both: what each message is sent for decides. Heartbeats and KV reads are counted per
    node-second, pulls and acks per task (medians over the points); the server's messages per node-second are those
    two rates, in and out; the rest of its messages, and the dataflow's CPU, per trajectory (least squares through 0).
    """
    per_node = {k: statistics.median(p["rates"][f"{k}_per_s"] / p["nodes"] for p in points) for k in ("heartbeats", "kv_reads")}
    per_task = {k: statistics.median(p["rates"][f"{k}_per_s"] / p["tasks_per_s"] for p in points) for k in ("pulls", "acks")}
    node_msgs = 2 * sum(per_node.values())  # each heartbeat and KV read goes in and comes out (delivered, answered)
    by_traj = [[p["traj_per_s"]] for p in points]
    f = {"dataflow_ms_per_traj": 1000 * fit(by_traj, [p["cores"]["dataflow"] for p in points])[0], "dataflow_ms_per_node_s": 0.0,
         "msgs_per_traj": fit(by_traj, [msgs(p) - node_msgs * p["nodes"] for p in points])[0], "msgs_per_node_s": node_msgs,
         "rates": {"heartbeats": (0.0, per_node["heartbeats"]), "kv_reads": (0.0, per_node["kv_reads"]),
                   "pulls": (per_task["pulls"], 0.0), "acks": (per_task["acks"], 0.0)},
         "server_us_per_msg": statistics.median(1e6 * p["cores"]["server"] / max(1.0, msgs(p)) for p in points)}
    src = {"dataflow_ms_per_traj": f"{where}: dataflow cores = a · traj/s",
           "dataflow_ms_per_node_s": "0: not separable from the cost per trajectory on these points (see pool_calibration.py)",
           "msgs_per_traj": f"{where}: server msgs in + out (less the counter's copies) less those per node-second, per traj/s",
           "msgs_per_node_s": f"{where}: heartbeats and KV reads per node-second, in and out",
           "rates": f"{where}: heartbeats and KV reads per node-second, pulls and acks per task, medians",
           "server_us_per_msg": f"{where}: server cores / msgs in + out (less the counter's copies), median"}
    return f, src


def generator_kept_up(point: Mapping[str, Any]) -> bool:
    """The load generator's nodes kept up at this point of pool_scale.json: none was silent longer than a live node may
    be (3 heartbeats). Past that the node processes are starved on the shared cores and the point measures the
    generator, not the plane: it is shown beside the model, never fitted."""
    from astraflow.streams.messages import HEARTBEAT_PERIOD_S

    return float(point["rates"].get("heartbeat_gap_max_s", 0.0)) <= 3 * HEARTBEAT_PERIOD_S


def plane_recorded(page: str, group_size: int = 8) -> tuple[dict[str, Any], dict[str, str]]:
    """Without enough pool_scale.json points: CPU per trajectory from the recorded 'CPU seconds per role' table
    (CPU-s per 64 samples, median of its four runs); the message counts are assumptions."""
    from astraflow.streams.messages import HEARTBEAT_PERIOD_S

    where = "BENCHMARKS.md 'CPU seconds per role' (recorded by hand; 2 nodes, ~260 samples/s)"
    per_task = 6  # assumption: the pull, the task, the group and its publish ack, the task's ack, the dataflow's read
    server_ms = statistics.median(recorded(page, "CPU seconds per role", "nats-server")) / 64 * 1000
    f = {"dataflow_ms_per_traj": statistics.median(recorded(page, "CPU seconds per role", "dataflow")) / 64 * 1000,
         "dataflow_ms_per_node_s": 0.0, "msgs_per_traj": per_task / group_size, "msgs_per_node_s": 2 / HEARTBEAT_PERIOD_S,
         "server_us_per_msg": 1000 * server_ms / (per_task / group_size),
         "rates": {"heartbeats": (0.0, 1 / HEARTBEAT_PERIOD_S), "kv_reads": (0.0, 0.0), "pulls": (1.0, 0.0), "acks": (1.0, 0.0)}}
    src = {"dataflow_ms_per_traj": where, "dataflow_ms_per_node_s": "assumption: 0 (not measured here)",
           "msgs_per_traj": f"assumption: {per_task} messages per task of {group_size}",
           "msgs_per_node_s": "a heartbeat in and out every HEARTBEAT_PERIOD_S (streams/messages.py)",
           "server_us_per_msg": f"{where}: server CPU per trajectory over the assumed messages per trajectory",
           "rates": "heartbeats: 1 / HEARTBEAT_PERIOD_S per node; assumption: one pull and one ack per task, no KV reads"}
    return f, src


def load(results: Path = RESULTS, page: Path = PAGE, pool_scale: Path | None = None) -> Calibration:
    """The calibration from ``results`` (``pool_scale``: another pool_scale.json than the one there)."""
    text = page.read_text()
    fan = json.loads((results / "fanout.json").read_text())
    base, hub, leaf = fit_fanout(fan["runs"])
    chaos = json.loads((results / "server_chaos.json").read_text())
    clean = {r["cluster"]: r["server_cpu_s"] for r in chaos["runs"] if not r["kills"]}
    stalls = [k["stall_s"] for r in chaos["runs"] if r["cluster"] > 1 for k in r["kills"]]
    scale_file = pool_scale or results / "pool_scale.json"
    points = [p for p in json.loads(scale_file.read_text())["points"] if generator_kept_up(p)] if scale_file.exists() else []
    single = [p for p in points if p["topology"] == "single"]
    if len(single) >= MIN_POINTS:
        plane, src = plane_measured(single, f"pool_scale.json (single server, {', '.join(str(p['nodes']) for p in single)} nodes)")
    else:
        plane, src = plane_recorded(text)
    factor, factor_src = clean[3] / clean[1], "server_chaos.json: server CPU of the clean runs, cluster of 3 / one server"
    per = {(p["topology"], p["nodes"]): p["cpu_ms_per_traj"]["server"] for p in points}
    ratios = [per["cluster3", n] / per["single", n] for t, n in per if t == "single" and ("cluster3", n) in per]
    if len(ratios) >= MIN_POINTS:
        factor, factor_src = statistics.median(ratios), "pool_scale.json: server CPU per trajectory, cluster3 / single, median"
    deltas = "BENCHMARKS.md 'Weight deltas' (bench_delta.py writes no results file; recorded by hand)"
    per_changed = recorded(text, "Weight deltas", "bytes / changed element")[0]
    payload_mb = recorded(text, "Weight deltas", "payload")[0]
    params = re.search(r"\(([\d.]+)M params", text.split("\n## Weight deltas", 1)[1])
    cores = re.match(r"(\d+) cores", fan["machine"])
    if params is None or cores is None:
        raise ValueError("BENCHMARKS.md's 'Weight deltas' names no '(N M params)', or fanout.json no 'N cores'")
    flat = sum(1 for r in fan["runs"] if not r.get("relays"))
    fit_src = f"fanout.json: to-all = base + hub copies × a + busiest mirror's copies × b, least squares, its {flat} runs without relays"
    src |= {"cluster_cpu_factor": factor_src,
            "election_stall_s": "server_chaos.json: the longest stall of a cluster member's kill (the member leading the streams)",
            "fanout_base_s": fit_src, "hub_copy_s": fit_src, "leaf_copy_s": fit_src,
            "fanout_bytes": "fanout.json: the median delta", "fanout_cores": "fanout.json: its machine",
            "bytes_per_changed": f"{deltas}, lr 1e-6",
            "changed_fraction": f"{deltas}: payload / bytes per changed element / parameters"}
    return Calibration(**plane, cluster_cpu_factor=factor, election_stall_s=max(stalls), fanout_base_s=base, hub_copy_s=hub,
                       leaf_copy_s=leaf, fanout_bytes=statistics.median(r["delta_bytes"] for r in fan["runs"]),
                       fanout_cores=int(cores[1]), bytes_per_changed=per_changed,
                       changed_fraction=payload_mb * 1e6 / per_changed / (float(params[1]) * 1e6), sources=src)
