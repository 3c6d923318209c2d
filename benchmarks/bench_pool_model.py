"""The pool model (``pool_model.py``) against what was measured, then at 10,000 nodes in 10 regions with an 8B model.

(a) Checks, where a measured run exists:

* fan-out (``results/fanout.json``): the time until every node holds a version, for each run: the fit over all six
  runs, and out of sample, a fit without that run's node count (so N = 64 is predicted from N = 4 and 16); the copies
  the hub and the busiest mirror sent;
* the pool (``results/pool_scale.json``): trajectories/s, task latency p50/p99 (from the dataflow's issue) and service
  time p50/p99 (from the node's pull) at each measured node count. The model
  gets that run's setup (latency, slots, group, the dataflow's budget from ``bench_pool_scale.recipe``) and its machine:
  every process shares its cores, so each group also queues for them, with the CPU per trajectory of all processes
  together (and of the dataflow alone, on its one core) fitted on the other points of the same topology
  (leave-one-out; in sample where a topology has one point).

(b) At scale, three layouts of the same pool: every node reads its region's mirror, the same with nodes relaying to
``--relay`` peers, and every node reading the hub. Printed: trajectories/s, staleness, drops, the dataflow's use,
per-version hub and mirror egress, the time until every node holds a version, and what each tier needs.

Scale inputs that nothing here measured (the pool's latency and slots, the trainer's step, the servers' cores and
links) are flags, recorded with the results as assumptions. Writes ``results/pool_model.json`` and
``figures/pool-model.png``.

    python benchmarks/bench_pool_model.py [--nodes 10000] [--regions 10] [--params 8e9] [--relay 8] ...
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from pool_calibration import RESULTS, fit, fit_fanout, generator_kept_up, load  # noqa: E402
from pool_model import Calibration, Latency, Links, Pool, fanout, relayed, simulate, size_tiers  # noqa: E402
from result_files import write  # noqa: E402

FIGURE = ROOT / "benchmarks" / "figures" / "pool-model.png"
LABELS = {"traj_per_s": "traj/s", "p50_s": "task p50 s", "p99_s": "task p99 s", "service_p50_s": "service p50 s",
          "service_p99_s": "service p99 s"}


def err(pred: float, meas: float | None) -> float | None:
    return (pred - meas) / meas if meas and math.isfinite(pred) else None


def pct(e: float | None) -> str:
    return "—" if e is None else f"{100 * e:+.0f} %"


def finite(x: Any) -> Any:
    """The record with every NaN or infinity as null (JSON has neither)."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


# ------------------------------------------------------------------------------------------------ (a) fan-out
def fanout_check(cal: Calibration) -> list[dict[str, Any]]:
    runs = json.loads((RESULTS / "fanout.json").read_text())["runs"]
    rows = []
    for r in runs:
        rest = [x for x in runs if x["nodes"] != r["nodes"]]
        base, hub, leaf = fit_fanout(rest)
        out = Links(base, cal.fanout_bytes / hub, cal.fanout_bytes / leaf, cal.fanout_bytes / leaf)
        relays = r.get("relays", 0)
        if relays:  # never fitted: predicted from the runs without relays
            model, per_relay = relayed(r["nodes"], r["regions"], relays, r["delta_bytes"], cal.links())
            held_out, _ = relayed(r["nodes"], r["regions"], relays, r["delta_bytes"], out)
        else:
            model, held_out, per_relay = fanout(r["nodes"], r["regions"], r["delta_bytes"], cal.links()), \
                fanout(r["nodes"], r["regions"], r["delta_bytes"], out), 0
        rows.append({"mode": r["mode"], "nodes": r["nodes"], "regions": r["regions"], "relays": relays, "measured_s": r["to_all_s"],
                     "fit_s": model.to_all_s, "out_of_sample_s": held_out.to_all_s,
                     "hub_copies": r["hub_copies"], "hub_copies_model": model.hub_copies,
                     "leaf_copies": r["leaf_copies_max"], "leaf_copies_model": model.leaf_copies,
                     "relay_copies": r.get("relay_copies_max", 0.0), "relay_copies_model": per_relay})
    return rows


# ------------------------------------------------------------------------------------------------ (a) the pool
def dataflow_settings(setup: dict[str, Any], nodes: int) -> dict[str, Any]:
    """The run's batch, staleness and in-flight bound: from its setup, else from the load generator's recipe."""
    keys = ("groups_per_batch", "max_staleness", "max_tasks_in_flight")
    if all(k in setup for k in keys):
        return {k: setup[k] for k in keys}
    from bench_pool_scale import recipe  # the load generator's own recipe, at this size (it imports the plane)

    return {k: recipe(nodes, 1)["dataflow"][k] for k in keys}


def per_traj(points: list[dict[str, Any]], part: str) -> float:
    """CPU-seconds per trajectory of ``part`` (cores = a · traj/s, least squares through 0). Trajectories/s grows with the
    nodes until the cores are full, so a per-node cost cannot be told apart from it on these points."""
    return fit([[p["traj_per_s"]] for p in points], [p["cores"][part] for p in points])[0]


def measured_pool(setup: dict[str, Any], nodes: int, basis: list[dict[str, Any]]) -> Pool:
    """The run's pool on its machine, with CPU costs fitted on ``basis``."""
    lat = Latency(setup["latency"], setup["latency_median_s"], setup.get("latency_sigma", 1.0), setup.get("latency_alpha", 1.5))
    d = dataflow_settings(setup, nodes)
    g = setup["group_size"]
    return Pool(nodes=nodes, slots_per_node=setup["slots_per_node"], group_size=g, latency=lat,
                groups_per_batch=d["groups_per_batch"], step_s=per_traj(basis, "trainer") * d["groups_per_batch"] * g,
                max_staleness=d["max_staleness"], max_tasks_in_flight=d["max_tasks_in_flight"],
                dataflow_ms_per_traj=1000 * per_traj(basis, "dataflow"), machine_cores=float(setup["cores"]),
                machine_ms_per_traj=1000 * per_traj(basis, "total"))


def measured_window(scale: dict[str, Any]) -> tuple[float, float]:
    """(window, warm-up before it) of the measured run, seconds after every node joined."""
    flag = re.search(r"--warmup (\S+)", scale["command"])
    warmup = scale["setup"].get("warmup_s", float(flag[1]) if flag else 10.0)  # 10: bench_pool_scale's default
    return float(scale["setup"]["window_s"]), float(warmup)


def predict(pool: Pool, window: tuple[float, float], joined_s: float, reps: int) -> dict[str, float]:
    """The run's own window after its own warm-up, from idle slots and a full budget as the run starts, averaged over
    ``reps`` seeds (a window of seconds holds few tasks). The node hosts took ``joined_s`` to start and join while the
    dataflow, started beside them, had issued its first tasks: the model starts every node when the last has joined,
    with the first tasks issued halfway through the joining (an assumption; with none, task latencies come out lower)."""
    runs = [simulate(pool, window[0], window[1], seed, backlog_s=joined_s / 2) for seed in range(reps)]
    return {"traj_per_s": float(np.mean([r.traj_per_s for r in runs])),
            "p50_s": float(np.nanmean([r.task_latency_p50_s for r in runs])),
            "p99_s": float(np.nanmean([r.task_latency_p99_s for r in runs])),
            "service_p50_s": float(np.nanmean([r.service_p50_s for r in runs])),
            "service_p99_s": float(np.nanmean([r.service_p99_s for r in runs])),
            "machine_util": float(np.mean([r.machine_util for r in runs])),
            "dataflow_util": float(np.mean([r.dataflow_util for r in runs]))}


def pool_check(path: Path, reps: int) -> dict[str, Any]:
    if not path.exists():
        return {"status": f"{path} not recorded yet: the pool check is skipped"}
    scale = json.loads(path.read_text())
    setup, window, points, rows, curves = scale["setup"], measured_window(scale), scale["points"], [], {}
    for topology in dict.fromkeys(p["topology"] for p in points):
        shown = [p for p in points if p["topology"] == topology]
        pts = [p for p in shown if generator_kept_up(p)]  # the points the generator kept up at: the only ones fitted
        for p in shown:
            others = [q for q in pts if q is not p]
            pred = predict(measured_pool(setup, p["nodes"], others or pts), window, p.get("joined_s", 0.0), reps)
            meas = {"traj_per_s": p["traj_per_s"], "p50_s": p["task_latency_s"]["p50"], "p99_s": p["task_latency_s"]["p99"]}
            if "service_s" in p:  # the node's pull to settled (bench_pool_scale records it beside the latency from issue)
                meas |= {"service_p50_s": p["service_s"]["p50"], "service_p99_s": p["service_s"]["p99"]}
            fitted = ("leave-one-out" if len(others) < len(pts) else "not fitted: the generator's nodes starved") if others else "in sample"
            rows.append({"topology": topology, "nodes": p["nodes"], "fit": fitted,
                         "measured": meas, "predicted": {k: pred[k] for k in meas},
                         "error": {k: err(pred[k], meas[k]) for k in meas}, "machine_util": pred["machine_util"],
                         "dataflow_util": pred["dataflow_util"], "bottleneck_measured": p["bottleneck"]})
        sizes = sorted({int(n) for n in np.geomspace(min(p["nodes"] for p in pts) / 2, 2 * max(p["nodes"] for p in pts), 9)})
        joined = statistics.median(p.get("joined_s", 0.0) for p in pts)
        curves[topology] = [{"nodes": n, "offered_traj_per_s": measured_pool(setup, n, pts).offered_traj_per_s,
                             "traj_per_s": predict(measured_pool(setup, n, pts), window, joined, max(1, reps // 2))["traj_per_s"]}
                            for n in sizes]
    return {"status": "checked", "source": {k: scale[k] for k in ("command", "machine", "date", "commit")}, "setup": setup,
            "window_s": window[0], "warmup_s": window[1], "points": rows, "curves": curves}


# ------------------------------------------------------------------------------------------------ (b) at scale
def layout(cal: Calibration, a: argparse.Namespace, pool: Pool, name: str, regions: int, relay: int | None) -> dict[str, Any]:
    """One layout of the pool: its fan-out, a simulated window, and what each tier needs at the simulated rate."""
    links = cal.links_at(a.server_cores, a.nic_gbps * 1e9 / 8)
    fan = fanout(a.nodes, regions, cal.delta_bytes(a.params, a.changed_fraction), links, relay)
    run = simulate(replace(pool, fanout_s=fan.to_all_s), a.window, seed=a.seed)
    tiers = size_tiers(cal, a.nodes, regions, run, fan, a.server_cores, a.nic_gbps * 1e9 / 8, a.headroom, a.step_s)
    return {"layout": name, "groups_per_batch": pool.groups_per_batch, "dataflow_shards": pool.dataflow_shards,
            "fanout": asdict(fan), "run": {**asdict(run), "staleness": {str(k): v for k, v in run.staleness.items()}},
            "sizing": [asdict(t) for t in tiers],
            "election": {"stall_s": cal.election_stall_s, "versions": cal.election_stall_s / run.version_interval_s,
                         "trajectories": cal.election_stall_s * run.traj_per_s}}


def at_scale(cal: Calibration, a: argparse.Namespace) -> dict[str, Any]:
    """The layouts at the scale's batch; then, with relays, one dataflow shard and other batches."""
    slots = a.nodes * a.slots
    budget_batch = math.ceil(slots / (a.max_staleness + 1))  # the batch whose staleness budget just covers every slot
    lat = Latency(a.latency, a.median_s, a.sigma, a.alpha)
    offered = slots * a.group / lat.mean_max(a.group)
    df_cores = (offered * cal.dataflow_ms_per_traj + a.nodes * cal.dataflow_ms_per_node_s) / 1000  # at the offered rate
    shards = a.shards or max(1, math.ceil(df_cores / a.headroom))
    pool = Pool(nodes=a.nodes, slots_per_node=a.slots, group_size=a.group, latency=lat,
                groups_per_batch=a.batches * budget_batch, step_s=a.step_s, max_staleness=a.max_staleness,
                dataflow_ms_per_traj=cal.dataflow_ms_per_traj, dataflow_shards=shards,
                dataflow_idle=min(0.99, a.nodes * cal.dataflow_ms_per_node_s / 1000 / shards))
    relayed = f"mirrors + relays of {a.relay}"
    layouts = [layout(cal, a, pool, "mirrors", a.regions, None), layout(cal, a, pool, relayed, a.regions, a.relay),
               layout(cal, a, pool, "hub only", 0, None)]
    variants = [layout(cal, a, replace(pool, groups_per_batch=m * budget_batch), relayed, a.regions, a.relay)
                for m in (1, 2, 4) if m != a.batches]
    if shards > 1:
        variants.append(layout(cal, a, replace(pool, dataflow_shards=1, dataflow_idle=min(0.99, pool.dataflow_idle * shards)),
                               relayed, a.regions, a.relay))
    assumptions = {"nodes": a.nodes, "regions": a.regions, "params": a.params, "slots_per_node": a.slots, "group_size": a.group,
                   "latency": a.latency, "latency_median_s": a.median_s, "latency_sigma": a.sigma, "max_staleness": a.max_staleness,
                   "groups_per_batch": pool.groups_per_batch, "step_s": a.step_s, "relay": a.relay, "server_cores": a.server_cores,
                   "nic_gbps": a.nic_gbps, "headroom": a.headroom, "window_s": a.window}
    return {"assumptions": assumptions, "delta_bytes": cal.delta_bytes(a.params, a.changed_fraction),
            "changed_fraction": a.changed_fraction or cal.changed_fraction,
            "links": asdict(cal.links_at(a.server_cores, a.nic_gbps * 1e9 / 8)), "offered_traj_per_s": offered,
            "task_mean_s": lat.mean_max(a.group), "budget_batch": budget_batch, "dataflow_cores_offered": df_cores,
            "layouts": layouts, "variants": variants}


# ------------------------------------------------------------------------------------------------ output
def plot(fan: list[dict[str, Any]], check: dict[str, Any], scale: dict[str, Any], path: Path, cal: Calibration) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((f1, f2), (f3, f4)) = plt.subplots(2, 2, figsize=(12, 8.5))
    n = np.geomspace(2, 128, 40)
    for i, (mode, regions) in enumerate((("direct", 0), ("mirrored", 3))):
        f1.plot(n, [1e3 * fanout(int(x), regions, cal.fanout_bytes, cal.links()).to_all_s for x in n], color=f"C{i}",
                label=f"model, {mode}")
        mine = [r for r in fan if r["mode"] == mode]
        f1.plot([r["nodes"] for r in mine], [1e3 * r["measured_s"] for r in mine], "o", color=f"C{i}", label=f"measured, {mode}")
        f1.plot([r["nodes"] for r in mine], [1e3 * r["out_of_sample_s"] for r in mine], "x", color=f"C{i}", ms=9,
                label=f"out of sample, {mode}")
    f1.set(xscale="log", xlabel="nodes", ylabel="ms until every node holds a version", title="fan-out (fanout.json, 3 regions)")
    f1.legend(fontsize=7)
    if check["status"] == "checked":
        for i, (topology, curve) in enumerate(check["curves"].items()):
            pts = [r for r in check["points"] if r["topology"] == topology]
            n_curve, n_pts, c = [x["nodes"] for x in curve], [r["nodes"] for r in pts], f"C{i}"
            f2.plot(n_curve, [x["traj_per_s"] for x in curve], color=c, label=f"model, {topology}")
            f2.plot(n_curve, [x["offered_traj_per_s"] for x in curve], ":", color=c, label="offered (Little's law)")
            f2.plot(n_pts, [r["measured"]["traj_per_s"] for r in pts], "o", color=c, label=f"measured, {topology}")
            f2.plot(n_pts, [r["predicted"]["traj_per_s"] for r in pts], "x", color=c, ms=9, label="predicted")
            for q, style in (("p50_s", "o"), ("p99_s", "s")):
                f3.plot(n_pts, [r["measured"][q] for r in pts], style, color=c, label=f"measured {q[:3]}, {topology}")
                f3.plot(n_pts, [r["predicted"][q] for r in pts], "x", color=c, ms=9)
        measured = sorted({r["nodes"] for r in check["points"]})
        for ax in (f2, f3):
            ax.set_xscale("log")
            ax.set_xticks(measured, [str(x) for x in measured])
            ax.minorticks_off()
            ax.legend(fontsize=7)
    else:
        for ax in (f2, f3):
            ax.text(0.5, 0.5, check["status"], ha="center", va="center", wrap=True, fontsize=8, transform=ax.transAxes)
    f2.set(xlabel="nodes", ylabel="trajectories/s", title="the pool on one machine (pool_scale.json, x: left out of the fit)")
    f3.set(xlabel="nodes", ylabel="task latency from issue, s (x: predicted)", title="task latency p50 (circles) / p99 (squares)")
    width = 0.8 / len(scale["layouts"])
    for i, lay in enumerate(scale["layouts"]):
        share = {int(k): v for k, v in lay["run"]["staleness"].items()}
        f4.bar([k + (i - 1) * width for k in share], list(share.values()), width,
               label=f"{lay['layout']}: {lay['run']['traj_per_s']:,.0f} traj/s, to all {lay['fanout']['to_all_s']:,.1f} s")
    s = scale["assumptions"]
    f4.set(xlabel="staleness (trainer version − generating version)", ylabel="share of trained groups",
           title=f"{s['nodes']:,} nodes, {s['regions']} regions, {s['params'] / 1e9:g}B: staleness")
    f4.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def tables(console: Console, cal: Calibration, fan: list[dict[str, Any]], check: dict[str, Any], scale: dict[str, Any]) -> None:
    t = Table(title="calibration")
    for c in ("figure", "value", "from"):
        t.add_column(c)
    for k, v in asdict(cal).items():
        if k != "sources":
            t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v), cal.sources.get(k, ""))
    console.print(t)
    t = Table(title="fan-out: time until every node holds a version")
    for c in ("nodes", "read from", "measured", "model (fit on all)", "out of sample", "error out of sample", "hub copies", "leaf copies"):
        t.add_column(c)
    for r in fan:
        t.add_row(str(r["nodes"]), r["mode"], f"{1e3 * r['measured_s']:.0f} ms", f"{1e3 * r['fit_s']:.0f} ms",
                  f"{1e3 * r['out_of_sample_s']:.0f} ms", pct(err(r["out_of_sample_s"], r["measured_s"])),
                  f"{r['hub_copies']:.2f} / {r['hub_copies_model']}", f"{r['leaf_copies']:.2f} / {r['leaf_copies_model']}")
    console.print(t)
    if check["status"] != "checked":
        console.print(f"[yellow]{check['status']}[/]")
    else:
        t = Table(title="the pool on one machine: measured / predicted (error)")
        keys = list(check["points"][0]["measured"])
        for c in ("topology", "nodes", "fit", *(LABELS[k] for k in keys), "machine busy (model)", "measured bottleneck"):
            t.add_column(c)
        for r in check["points"]:
            m, p, e = r["measured"], r["predicted"], r["error"]
            t.add_row(r["topology"], str(r["nodes"]), r["fit"], *(f"{m[k]} / {p[k]:.1f} ({pct(e[k])})" for k in m),
                      f"{100 * r['machine_util']:.0f} %", r["bottleneck_measured"])
        console.print(t)
    t = Table(title=f"at scale: {json.dumps(scale['assumptions'])}")
    for c in ("layout", "batch", "dataflow shards", "traj/s", "staleness mean", "dropped", "dataflow busy", "slots busy",
              "version every", "hub egress / version", "mirror egress / version", "to every node"):
        t.add_column(c)
    for lay in scale["layouts"] + scale["variants"]:
        r, f = lay["run"], lay["fanout"]
        t.add_row(lay["layout"], f"{lay['groups_per_batch']:,}", str(lay["dataflow_shards"]), f"{r['traj_per_s']:,.0f}",
                  f"{r['staleness_mean']:.2f}", f"{100 * r['dropped_share']:.1f} %",
                  f"{100 * r['dataflow_util']:.0f} %", f"{100 * r['slot_util']:.0f} %", f"{r['version_interval_s']:.1f} s",
                  f"{f['hub_bytes'] / 1e9:,.1f} GB", f"{f['leaf_bytes'] / 1e9:,.1f} GB", f"{f['to_all_s']:,.1f} s")
    console.print(t)
    t = Table(title="what each tier needs")
    for c in ("layout", "tier", "msgs/s", "egress", "cores", "needs"):
        t.add_column(c)
    for lay in scale["layouts"]:
        for s in lay["sizing"]:
            t.add_row(lay["layout"], s["tier"], f"{s['msgs_per_s']:,.0f}", f"{s['egress_bytes_per_s'] / 1e9:.2f} GB/s",
                      f"{s['cores']:.1f}", f"{s['needs']} × {s['unit']}")
    console.print(t)


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--regions", type=int, default=10)
    ap.add_argument("--params", type=float, default=8e9, help="the model's parameters (bf16)")
    ap.add_argument("--changed-fraction", type=float, default=None, help="default: the measured one (Weight deltas, lr 1e-6)")
    ap.add_argument("--slots", type=int, default=8, help="assumption: tasks a node rolls out at once")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--latency", choices=["lognormal", "pareto", "constant"], default="lognormal")
    ap.add_argument("--median-s", type=float, default=30.0, help="assumption: a request's median generation time")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal shape (1.0: a long tail)")
    ap.add_argument("--alpha", type=float, default=1.5, help="pareto tail index")
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--batches", type=int, default=2,
                    help="groups per batch, in units of nodes × slots / (max_staleness + 1) (the batch whose budget just covers the slots)")
    ap.add_argument("--step-s", type=float, default=20.0, help="assumption: the trainer's step")
    ap.add_argument("--relay", type=int, default=8, help="copies a relaying node passes on")
    ap.add_argument("--server-cores", type=int, default=16, help="assumption: cores of a plane server")
    ap.add_argument("--nic-gbps", type=float, default=25.0, help="assumption: a server's (and a relaying node's) link")
    ap.add_argument("--headroom", type=float, default=0.5, help="the share of a server's cores and link a tier may use")
    ap.add_argument("--shards", type=int, default=0, help="dataflow shards (0: as many as the offered rate needs at the headroom)")
    ap.add_argument("--window", type=float, default=600.0, help="simulated seconds measured (after a warm-up)")
    ap.add_argument("--reps", type=int, default=8, help="seeds averaged per measured pool point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-scale", type=Path, default=RESULTS / "pool_scale.json", help="bench_pool_scale's figures")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/pool_model.json")
    ap.add_argument("--figure", type=Path, default=FIGURE)
    a = ap.parse_args()
    console = Console(width=200)
    cal = load(pool_scale=a.pool_scale)
    fan = fanout_check(cal)
    check = pool_check(a.pool_scale, a.reps)
    scale = at_scale(cal, a)
    tables(console, cal, fan, check, scale)
    plot(fan, check, scale, a.figure, cal)
    record = finite({"calibration": asdict(cal), "fanout_check": fan, "pool_check": check, "scale": scale,
                     "figure": str(a.figure.resolve().relative_to(ROOT)) if a.figure.resolve().is_relative_to(ROOT) else str(a.figure)})
    write("pool_model", record, a.out)
    return record


if __name__ == "__main__":
    print(json.dumps(main(), default=str))
