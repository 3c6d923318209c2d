"""Render BENCHMARKS.md's sections from the figures the benchmarks wrote (``benchmarks/results/*.json``).

A rendered section sits between ``<!-- rendered: NAME -->`` and ``<!-- end rendered -->``; this
script replaces what lies between them with the table made from ``results/NAME.json`` (its
command, machine, date and commit first), so the page shows what was run. ``--check`` changes
nothing and exits 1 if a section differs from its rendering (``tests/test_benchmarks_page.py``).

    python benchmarks/render.py [--check]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pool_model import on_links

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks" / "results"
SECTION = re.compile(r"(<!-- rendered: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end rendered -->)", re.S)


def provenance(r: dict[str, Any]) -> str:
    return f"`{r['command']}` on {r['machine']}, {r['date']}, at {r['commit']}.\n\n"


def partial_rollouts(r: dict[str, Any]) -> str:
    def share(x: dict[str, Any]) -> str:
        return f"{100 * x['switched_share']:.1f} %" if "switched_share" in x else "not recorded"

    rows = ["| seed | partial rollouts | RL wall s | samples/s | completion tokens (mean) | trajectories that switched version "
            "| held-out v0 → last | held-out at equal wall time |", "|---|---|---|---|---|---|---|---|"]
    for run in sorted(r["runs"], key=lambda x: (x["seed"], x["partial_rollouts"])):
        rows.append(f"| {run['seed']} | {'on' if run['partial_rollouts'] else 'off'} | {run['rl_wall_s']:.1f} | "
                    f"{run['samples_per_s']:.1f} | {run['completion_tokens_mean']:.1f} | {share(run)} | {run['held_out_v0']:.3f} → "
                    f"{run['held_out_last']:.3f} | {run['held_out_at_equal_wall']:.3f} ({run['equal_wall_s']:.1f} s) |")
    for mode in ("off", "on"):
        m = r[mode]
        rows.append(f"| mean | {mode} | {m['rl_wall_s']:.1f} | {m['samples_per_s']:.1f} | {m['completion_tokens_mean']:.1f} | "
                    f"{share(m)} | → {m['held_out_last']:.3f} | {m['held_out_at_equal_wall']:.3f} |")
    return f"{r['steps']} steps, `max_new_tokens` {r['max_new_tokens']}. " + provenance(r) + "\n".join(rows) + "\n"


def generation_stall(r: dict[str, Any]) -> str:
    ms = "{:,.1f} ms".format
    rows = ["| size | parameters (bf16) | decoding step | off: batch stalls | off: next batch waits (apply) | "
            "off: version lands after | on: batch stalls | on: version lands after |", "|---|---|---|---|---|---|---|---|"]
    for s in r["sizes"]:
        off, on = s["off"], s["on"]
        rows.append(f"| {s['size']} | {s['parameters'] / 1e6:,.2f} M ({s['bf16_bytes'] / 2**20:,.1f} MiB) | {ms(1e3 * off['step_s'])} | "
                    f"{ms(1e3 * max(off['stall_s'], 0))} | {ms(1e3 * off['apply_s'])} | {ms(1e3 * off['landed_after_s'])} | "
                    f"{ms(1e3 * on['stall_s'])} | {ms(1e3 * on['landed_after_s'])} |")
    return (f"{r['rows']} rows × {r['tokens']} new tokens, medians of {r['repeats']}. " + provenance(r) + "\n".join(rows)
            + "\n")


def vllm_stall(r: dict[str, Any]) -> str:
    ms = "{:,.1f} ms".format
    rows = ["| size | parameters (bf16) | delta | decoding step | training step | in place: generation held | "
            "of it, the worker's install | in place: announced → served | staged: generation held | "
            "staged: writing the model directory |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in r["sizes"]:
        ip, st = s["in_place"], s["staged"]
        rows.append(f"| {s['size']} | {s['parameters'] / 1e6:,.2f} M ({s['bf16_bytes'] / 2**20:,.1f} MiB) | "
                    f"{ip['bytes'] / 2**20:,.2f} MiB | {ms(1e3 * s['decode_step_s'])} | {ms(1e3 * s['train_step_s'])} | "
                    f"{ms(1e3 * ip['stall_s'])} | "
                    f"{ms(1e3 * ip['install_s'])} | {ms(1e3 * ip['landed_s'])} | {ms(1e3 * st['stall_s'])} | {ms(1e3 * st['stage_s'])} |")
    return (f"`vllm.LLM` ({r['mode']}), {r['versions']} dense versions per size, medians; the decoding step is one of "
            f"{r['rows']} rows. " + provenance(r) + "\n".join(rows) + "\n")


def vllm_partial(r: dict[str, Any]) -> str:
    ms = "{:,.1f} ms".format
    rows = ["| size | partial rollouts | announced → served (median) | (largest) | generation held | completions | "
            "of them, two versions | tokens/s | a generation call |", "|---|---|---|---|---|---|---|---|---|"]
    for s in r["runs"]:
        rows.append(f"| {s['size']} ({s['parameters'] / 1e6:,.2f} M) | {'on' if s['partial_rollouts'] else 'off'} | "
                    f"{ms(1e3 * s['landed_s'])} | {ms(1e3 * s['landed_max_s'])} | {ms(1e3 * s['stall_s'])} | {s['completions']:,} | "
                    f"{s['switched']:,} | {s['tokens_per_s']:,.0f} | {ms(1e3 * s['call_s'])} |")
    return (f"`vllm.LLM` ({r['mode']}), {r['versions']} dense versions per run, announced while calls of {r['rows']} rows of up to "
            f"{r['tokens']} new tokens run back to back; medians over the versions. " + provenance(r) + "\n".join(rows) + "\n")


def house(r: dict[str, Any]) -> str:
    from bench_house import FIGURES, cell

    trees = r["trees"]
    rows = ["| figure | " + " | ".join(t["package"] for t in trees) + " |", "|---" * (len(trees) + 1) + "|"]
    rows += [f"| {key.replace('_', ' ')} | " + " | ".join(cell(t[key]) for t in trees) + " |" for key in FIGURES]
    return provenance(r) + "\n".join(rows) + "\n"


def hostile_node(r: dict[str, Any]) -> str:
    def opt(run: dict[str, Any], key: str, fmt: str = "{}") -> str:
        return fmt.format(run[key]) if run.get(key) is not None else "–"

    rows = ["| run | seed | held-out v0 | held-out, last 5 evaluations | lies told | lies that broke a claim, trained | "
            "honest trajectories refused | left out by the trainer (suspect) | largest logprob gap of a step | "
            "largest batch reward mean | first lie to quarantine | quarantine to connection closed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in sorted(r["runs"], key=lambda x: (x["seed"], x["mode"])):
        rows.append(f"| {run['mode']} | {run['seed']} | {run['held_out_v0']:.3f} | {run['held_out_last5']:.3f} | {run['lies_told']:,} | "
                    f"{run['lies_trained']:,} | {run['honest_refused']} | {opt(run, 'suspect_trajectories', '{:,}')} | "
                    f"{opt(run, 'logprob_gap_max', '{:.2f}')} | {run['max_batch_reward_mean']:.3g} | "
                    f"{opt(run, 'quarantine_s', '{:.2f} s')} | {opt(run, 'cut_off_s', '{:.2f} s')} |")
    for mode, mean in r["held_out_last5_mean"].items():
        rows.append(f"| mean: {mode} | | | {mean:.3f} | | | | | | | | |")
    cost = ", ".join(f"`{k}` {v:,.0f} µs" for k, v in r["claim_check_us"].items())
    return (f"{r['steps']} steps, the lying node lies for {r['lie_s']:.0f} s or until it is cut off. " + provenance(r) + "\n".join(rows)
            + f"\n\nClaim checks per trajectory (decode, prompt tokens, range, the reward scored again), by reward: {cost}.\n")


def lora(r: dict[str, Any]) -> str:
    def est(e: list[float]) -> str:
        return f"{e[0]:.3f} ± {e[1]:.3f}" if e[2] > 1 else f"{e[0]:.3f} (1 run)"

    def kib(n: float) -> str:
        return f"{n / 1024:.1f} KiB" if n < 1024 ** 2 else f"{n / 1024 ** 2:.2f} MiB"

    rows = ["| run | seed | held-out v0 | held-out, last 5 evaluations | rise over v0 | at equal wall time | "
            "bytes per version (mean delta) | base stored | trainer step (median) | trainer CPU per 64 samples | "
            "node CPU per 64 samples | wall |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in sorted(r["runs"], key=lambda x: (x["seed"], x["mode"])):
        rows.append(f"| {run['mode']} | {run['seed']} | {run['held_out_v0']:.3f} | {run['held_out_last5']:.3f} | "
                    f"{run['held_out_last5'] - run['held_out_v0']:+.3f} | {run['held_out_equal_time']:.3f} | "
                    f"{kib(run['delta_bytes_mean'])} | "
                    f"{kib(run['base_bytes']) if run['base_bytes'] else '–'} | "
                    f"{1e3 * run['step_s_median']:.1f} ms | {run['trainer_cpu_s_per_64']:.3f} s | {run['node_cpu_s_per_64']:.3f} s | "
                    f"{run['wall_s']:.0f} s |")
    for mode, s in r["summary"].items():
        rise = f"+{est(s['rise'])}" if "rise" in s else "–"
        rows.append(f"| mean: {mode} | | | {est(s['held_out_last5'])} | {rise} | {est(s['held_out_equal_time'])} | "
                    f"{kib(s['delta_bytes_mean'])} | | {1e3 * s['step_s_median']:.1f} ms | | {s['node_cpu_s_per_64']:.3f} s | "
                    f"{s['wall_s']:.0f} s |")
    d = r["lora_minus_full"]
    rows.append(f"| LoRA − full, paired by seed | | | {d['held_out_last5'][0]:+.3f} ± {d['held_out_last5'][1]:.3f} | | "
                f"{d['held_out_equal_time'][0]:+.3f} ± {d['held_out_equal_time'][1]:.3f} | | | | | | |")
    path = ["| model | parameters | version announces | bytes per version (median) | first keyframe | trainer: image + publish | "
            "node: fetch + apply + install |", "|---|---|---|---|---|---|---|"]
    for row in r["path"]:
        path.append(f"| {row['model']} | {row['params'] / 1e6:.1f} M | {row['mode']} | {kib(row['bytes'])} | "
                    f"{kib(row['keyframe_bytes'])} | "
                    f"{1e3 * row['publish_s']:.1f} ms | {1e3 * row['apply_s']:.1f} ms |")
    targets = ", ".join(r.get("targets", ["q_proj", "k_proj", "v_proj", "o_proj"]))
    return (f"{r['steps']} steps, {r['seeds']} seeds, LoRA rank {r['rank']} on {targets} at lr {r['lora_lr']:g} (full "
            "fine-tuning at the recipe's 3e-4); intervals are 95 % Student-t over seeds. " + provenance(r) + "\n".join(rows)
            + f"\n\nThe per-version path, {r['path'][0]['versions']} versions each (medians, the first left out):\n\n"
            + "\n".join(path) + "\n")


def lora_team(r: dict[str, Any]) -> str:
    def est(e: list[float], sign: str = "") -> str:
        return f"{e[0]:{sign}.3f} ± {e[1]:.3f}" if e[2] > 1 else f"{e[0]:{sign}.3f} (1 run)"

    names = {"solver": "solver, greedy", "verifier": "the verifier's accuracy", "team": "team: the verifier's pick"}
    rows = ["| run | seed | subject | v0 | late (v ≥ half) | rise | at equal wall time | wall (base warm start) |",
            "|---|---|---|---|---|---|---|---|"]
    for run in sorted(r["runs"], key=lambda x: (x["seed"], x["mode"])):
        for k, name in names.items():
            rows.append(f"| {run['mode']} | {run['seed']} | {name} | {run['v0'][k]:.2f} | {run['late'][k]:.3f} | {run['rise'][k]:+.3f} | "
                        f"{run['equal_time'][k]:.2f} | {run['wall_s']:.0f} s ({run['base_warm_start_s']:.0f} s) |")
    for mode, s in r["summary"].items():
        for k, name in names.items():
            rows.append(f"| **mean: {mode}** | | {name} | {est(s[f'v0.{k}'])} | {est(s[f'late.{k}'])} | {est(s[f'rise.{k}'], '+')} | "
                        f"{est(s[f'equal_time.{k}'])} | {s['wall_s']:.0f} s |")
    for k, name in names.items():
        d = r["lora_minus_full"]
        rows.append(f"| **LoRA − full, paired by seed** | | {name} | | {est(d[f'late.{k}'], '+')} | | {est(d[f'equal_time.{k}'], '+')} | |")
    size = " · ".join(f"{m}: " + ", ".join(f"{p} {b / 1024:.1f} KiB" for p, b in s["delta_bytes_mean"].items())
                      for m, s in r["summary"].items())
    return (f"{r['steps']} steps, {r['seeds']} seeds; intervals are 95 % Student-t over seeds. Bytes per version (mean delta): "
            f"{size}. " + provenance(r) + "\n".join(rows) + "\n")


def shared_base(r: dict[str, Any]) -> str:
    rows = ["| policies | the node holds | memory for the models | generation (median) | tokens/s |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        rows.append(f"| {row['policies']} | {'one base + an adapter per policy' if row['shared_base'] else 'a merged model per policy'} | "
                    f"{row['rss_growth_mib']:.0f} MiB | {row['generate_s']:.2f} s | {row['tokens_per_s']:.0f} |")
    return (f"{r['requests']} requests per policy, {r['tokens']} new tokens each, median of {r['repeats']}. " + provenance(r)
            + "\n".join(rows) + "\n")


def fanout(r: dict[str, Any]) -> str:
    rows = ["| nodes | nodes read from | delta | copies the hub sent | copies the busiest leaf sent | copies the busiest relay sent | "
            "to every node | slowest version |", "|---|---|---|---|---|---|---|---|"]
    for run in r["runs"]:
        relays = run.get("relays", 0)
        where = ("the hub" if run["mode"] == "direct" else f"their region's leaf mirror ({run['regions']} regions)"
                 if not relays else f"a relay's mirror of their region's ({run['regions']} regions × {relays} relays)")
        leaf = f"{run['leaf_copies_max']:.2f}" if run["regions"] else "—"
        relay = f"{run['relay_copies_max']:.2f}" if relays else "—"
        rows.append(f"| {run['nodes']} | {where} | {run['delta_bytes'] / 2**20:.2f} MiB | {run['hub_copies']:.2f} | {leaf} | {relay} | "
                    f"{1000 * run['to_all_s']:.0f} ms | {1000 * run['to_all_s_max']:.0f} ms |")
    return (f"Medians over the delta versions of each run ({r['elements']:,} elements, {100 * r['changed_fraction']:.0f} % changed "
            "per version). " + provenance(r) + "\n".join(rows) + "\n")


def fanout_links(r: dict[str, Any]) -> str:
    rows = ["| nodes | nodes read from | servers from the hub to a node | copies the hub sent | copies the busiest leaf sent | "
            "copies the busiest relay sent | to every node | slowest version | the model's fan-out on these links | "
            "the links unpaced |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in r["runs"]:
        where = ("the hub" if run["mode"] == "direct" else f"a relay tree, {run['relays']} below each server "
                 f"({run['relay_servers']} relays)" if run["relay_servers"] else "their region's leaf"
                 + (" (the tree's one level)" if run["mode"] == "tree" else ""))
        leaf = f"{run['leaf_copies_max']:.2f}" if run["regions"] else "—"
        relay = f"{run['relay_copies_max']:.2f}" if run["relay_servers"] else "—"
        rows.append(f"| {run['nodes']} | {where} | {run['depth']} | {run['hub_copies']:.2f} | {leaf} | {relay} | "
                    f"{1000 * run['to_all_s']:.0f} ms | {1000 * run['to_all_s_max']:.0f} ms | {1000 * on_links(run):.0f} ms | "
                    + (f"{1000 * run['unpaced_to_all_s']:.0f} ms |" if run.get("unpaced_to_all_s") else "— |"))
    first = r["runs"][0]
    return (f"Every server on an emulated uplink of {r['link_bytes_per_s'] / 1e6:g} MB/s (`benchmarks/links.py`); one region; "
            f"medians over the delta versions of each run ({r['elements']:,} elements, {100 * r['changed_fraction']:.0f} % "
            f"changed per version: {first['delta_bytes'] / 2**20:.2f} MiB a delta). " + provenance(r) + "\n".join(rows) + "\n"
            + "".join(f"\nFailed: {f['mode']}, {f['nodes']} nodes: {f['error']}\n" for f in r.get("failed", [])))


def pool_scale(r: dict[str, Any]) -> str:
    s = r["setup"]
    rows = ["| servers | nodes | traj/s (offered) | CPU ms per trajectory: dataflow · server · nodes · trainer | "
            "cores: dataflow · server · nodes · all | server RSS | heartbeats · KV reads · pulls · acks per s | "
            "longest heartbeat gap | task p50 / p99 (from issue) | first bottleneck |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in r["points"]:
        c, k, q, t = p["cpu_ms_per_traj"], p["cores"], p["rates"], p["task_latency_s"]
        servers = "1" if p["topology"] == "single" else "3 (cluster, R3)"
        rows.append(f"| {servers} | {p['nodes']} | {p['traj_per_s']:.0f} ({p['offered_traj_per_s']:.0f}) | {c['dataflow']:.2f} · "
                    f"{c['server']:.2f} · {c['nodes']:.2f} · {c['trainer']:.2f} | {k['dataflow']:.2f} · {k['server']:.2f} · "
                    f"{k['nodes']:.2f} · {k['total']:.2f} | {p['server_rss_mib']:.0f} MiB | {q['heartbeats_per_s']:.0f} · "
                    f"{q['kv_reads_per_s']:.0f} · {q['pulls_per_s']:.0f} · {q['acks_per_s']:.0f} | {q['heartbeat_gap_max_s']:.1f} s | "
                    f"{t['p50']:.1f} / {t['p99']:.1f} s | {p['bottleneck']} |")
    return (f"Scripted engine, lognormal latency (median {s['latency_median_s']} s, sigma {s['latency_sigma']}) per request, "
            f"{s['slots_per_node']} task slots per node, groups of {s['group_size']}, nodes spread over {s['host_processes']} "
            f"processes; {s['window_s']:.0f} s measured per point; figure `benchmarks/figures/pool-scale.png`. " + provenance(r)
            + "\n".join(rows) + "\n" + "".join(f"\nFailed: {f['topology']}, {f['nodes']} nodes: {f['error']}\n"
                                                for f in r.get("failed", [])))


def facade(r: dict[str, Any]) -> str:
    rows = ["| way | wall per call (median) | engine time inside | overhead (median) | overhead (p90) |", "|---|---|---|---|---|"]
    for name, w in r["ways"].items():
        rows.append(f"| {name} | {w['wall_ms_median']:.1f} ms | {w['engine_ms_median']:.1f} ms | {w['overhead_ms_median']:.2f} ms | "
                    f"{w['overhead_ms_p90']:.2f} ms |")
    return (f"{r['calls']} calls each way, interleaved; {r['prompt_tokens']} prompt tokens, up to {r['max_new_tokens']} new. "
            + provenance(r) + "\n".join(rows) + "\n")


def moe(r: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "—" if x is None else f"{100 * x:.2f} %"

    def est(e: list[float], sign: str = "") -> str:
        return f"{e[0]:{sign}.3f} ± {e[1]:.3f}" if e[2] > 1 else f"{e[0]:{sign}.3f} (1 run)"

    sweep = ["| model | routes differing, fp32 node | mean \\|Δ logprob\\|: own / replayed | routes differing, bf16 node | "
             "mean \\|Δ logprob\\|: own / replayed | routes differing in training | mean \\|Δ logprob\\| in training |",
             "|---|---|---|---|---|---|---|"]
    for m in r["sweep"]:
        replayed = f" / {m['logprob_gap_replayed']:.4f}" if "logprob_gap_replayed" in m else ""
        replayed_bf16 = f" / {m['logprob_gap_replayed_bf16']:.4f}" if "logprob_gap_replayed_bf16" in m else ""
        sweep.append(f"| {m['model']} | {pct(m.get('routing_mismatch'))} | {m['logprob_gap_own']:.4f}{replayed} | "
                     f"{pct(m.get('routing_mismatch_bf16'))} | {m['logprob_gap_own_bf16']:.4f}{replayed_bf16} | "
                     f"{pct(m.get('routing_mismatch_training'))} | {m['logprob_gap_training']:.4f} |")
    learning = ["| configuration | held-out v0 | held-out, last 5 evaluations | rise | routes differing in training | "
                "mean \\|Δ logprob\\| in training | trainer step (median) | routing bytes per trajectory |",
                "|---|---|---|---|---|---|---|---|"]
    for name, s in r["summary"].items():
        routing_bytes = f"{s['routing_bytes']:.0f}" if "routing_bytes" in s else "—"
        learning.append(f"| {name} | {est(s['held_out_v0'])} | {est(s['held_out_last5'])} | {est(s['rise'], '+')} | "
                        f"{pct(s.get('routing_mismatch_training'))} | {s['logprob_gap_mean']:.4f} | {1e3 * s['step_s_median']:.1f} ms | "
                        f"{routing_bytes} |")
    for label, d in r["differences"].items():
        learning.append(f"| {label}, paired by seed | | {est(d['held_out_last5'], '+')} | {est(d['rise'], '+')} | | | | |")
    return (f"The mismatch at one version, {r['samples']} samples of each held-out prompt:\n\n" + "\n".join(sweep) + "\n\n"
            f"Learning, {r['seeds']} seeds (intervals: 95 % Student-t over seeds); figure `{r['figure']}`. " + provenance(r)
            + "\n".join(learning) + "\n")


def server_chaos(r: dict[str, Any]) -> str:
    def plane(run: dict[str, Any]) -> str:
        return "cluster of 3 (`up --cluster 3`)" if run["cluster"] == 3 else "one server"

    runs = ["| plane | run | wall | every version once | accounting adds up | held-out v0 → last | median gap between versions | "
            "nats-server CPU |", "|---|---|---|---|---|---|---|---|"]
    for run in r["runs"]:
        runs.append(f"| {plane(run)} | {len(run['kills'])} kills | {run['wall_s']:.0f} s | {'yes' if run['versions_once'] else 'no'} | "
                    f"{'yes' if run['adds_up'] else 'no'} | {run['held_out_v0']:.2f} → {run['held_out_last']:.2f} | "
                    f"{run['median_gap_s']:.2f} s | {run['server_cpu_s']:.1f} s |")
    kills = ["| plane | killed | training stalled | roles restarted (crashed on a plane timeout) |", "|---|---|---|---|"]
    for run in r["runs"]:
        for k in run["kills"]:
            kills.append(f"| {plane(run)} | {k['server']} | {k['stall_s']:.1f} s | {', '.join(k['roles_restarted']) or 'none'} |")
    return (f"{r['steps']} steps each. " + provenance(r) + "\n".join(runs) + "\n\n" + "\n".join(kills) + "\n")


def pool_model(r: dict[str, Any]) -> str:
    def pct(e: float | None) -> str:
        return "—" if e is None else f"{100 * e:+.0f} %"

    def gb(n: float) -> str:
        return "—" if not n else f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB" if n >= 1e6 else f"{n / 1e6:,.2f} MB"

    c, src = r["calibration"], r["calibration"]["sources"]
    rates = "; ".join(f"{k.replace('_', ' ')} {a:.2f} per task + {b:.3f} per node-s" for k, (a, b) in c["rates"].items())
    figures = [("dataflow CPU per trajectory", f"{c['dataflow_ms_per_traj']:.3f} ms", "dataflow_ms_per_traj"),
               ("dataflow CPU per node and second", f"{c['dataflow_ms_per_node_s']:.3f} ms", "dataflow_ms_per_node_s"),
               ("server CPU per message (in or out)", f"{c['server_us_per_msg']:.1f} µs", "server_us_per_msg"),
               ("server messages per trajectory", f"{c['msgs_per_traj']:.2f}", "msgs_per_traj"),
               ("server messages per node and second", f"{c['msgs_per_node_s']:.2f}", "msgs_per_node_s"),
               ("the plane's requests", rates, "rates"),
               ("cluster of 3: server CPU over one server's", f"{c['cluster_cpu_factor']:.2f}×", "cluster_cpu_factor"),
               ("stall when the streams' leader is killed", f"{c['election_stall_s']:.1f} s", "election_stall_s"),
               ("fan-out: fixed part", f"{1e3 * c['fanout_base_s']:.1f} ms", "fanout_base_s"),
               (f"fan-out: per copy of {gb(c['fanout_bytes'])}, hub / a mirror ({c['fanout_cores']} shared cores)",
                f"{1e3 * c['hub_copy_s']:.2f} / {1e3 * c['leaf_copy_s']:.2f} ms", "hub_copy_s"),
               ("delta bytes per changed element", f"{c['bytes_per_changed']:.3f}", "bytes_per_changed"),
               ("elements a step changes", f"{100 * c['changed_fraction']:.2f} %", "changed_fraction")]
    cal = ["| figure | value | from |", "|---|---|---|"] + [f"| {name} | {v} | {src.get(key, '')} |" for name, v, key in figures]
    fan = ["| nodes | read from | measured | model, fit on the runs without relays | out of sample: fit without this node count | "
           "error out of sample | hub copies: measured / model | busiest mirror's copies: measured / model | "
           "busiest relay's copies: measured / model |", "|---|---|---|---|---|---|---|---|---|"]
    for f in r["fanout_check"]:
        out_err = (f["out_of_sample_s"] - f["measured_s"]) / f["measured_s"]
        relays = f.get("relays", 0)
        where = ("the hub" if f["mode"] == "direct" else f"their region's mirror ({f['regions']} regions)" if not relays
                 else f"a relay of their region's mirror ({f['regions']} regions × {relays} relays)")
        relay = f"{f['relay_copies']:.2f} / {f['relay_copies_model']}" if relays else "—"
        fan.append(f"| {f['nodes']} | {where} | "
                   f"{1e3 * f['measured_s']:.0f} ms | {1e3 * f['fit_s']:.0f} ms | {1e3 * f['out_of_sample_s']:.0f} ms | {pct(out_err)} | "
                   f"{f['hub_copies']:.2f} / {f['hub_copies_model']} | {f['leaf_copies']:.2f} / {f['leaf_copies_model']} | {relay} |")
    check = r["pool_check"]
    if check["status"] != "checked":
        pool = f"The pool on one machine: {check['status']}.\n"
    else:
        s, src_run = check["setup"], check["source"]
        pool = (f"The pool on one machine, against `{src_run['command']}` ({src_run['date']}, at {src_run['commit']}): lognormal "
                f"latency, median {s['latency_median_s']} s, sigma {s['latency_sigma']}; {s['slots_per_node']} slots per node, groups of "
                f"{s['group_size']}, {s['cores']} shared cores; the model's window is the run's ({check['window_s']:.0f} s after "
                f"{check['warmup_s']:.0f} s of warm-up), averaged over seeds.\n\n"
                "| server | nodes | CPU fitted on | trajectories/s: measured / model | task p50 | task p99 | shared cores busy (model) "
                "| the run's bottleneck |\n|---|---|---|---|---|---|---|---|\n")
        for p in check["points"]:
            m, q, e = p["measured"], p["predicted"], p["error"]
            pool += (f"| {p['topology']} | {p['nodes']} | {p['fit']} | "
                     f"{m['traj_per_s']:,.1f} / {q['traj_per_s']:,.1f} ({pct(e['traj_per_s'])}) | "
                     f"{m['p50_s']:.1f} / {q['p50_s']:.1f} s ({pct(e['p50_s'])}) | "
                     f"{m['p99_s']:.1f} / {q['p99_s']:.1f} s ({pct(e['p99_s'])}) | "
                     f"{100 * p['machine_util']:.0f} % | {p['bottleneck_measured']} |\n")
    sc, a = r["scale"], r["scale"]["assumptions"]
    setup = (f"At scale: {a['nodes']:,} nodes in {a['regions']} regions, a model of {a['params'] / 1e9:g}B parameters (a delta of "
             f"{gb(sc['delta_bytes'])}: {100 * sc['changed_fraction']:.2f} % of the elements × {c['bytes_per_changed']:.3f} bytes). "
             f"Assumptions (flags): {a['slots_per_node']} tasks per node, groups of {a['group_size']}, each request {a['latency']} with "
             f"median {a['latency_median_s']:g} s and sigma {a['latency_sigma']:g} (a task {sc['task_mean_s']:.0f} s on average), "
             f"max_staleness {a['max_staleness']}, a trainer step of {a['step_s']:g} s, servers of {a['server_cores']} cores behind "
             f"{a['nic_gbps']:g} Gbit/s (every sender at {gb(sc['links']['hub_bps'])}/s), headroom {100 * a['headroom']:.0f} %. "
             f"Offered (every slot busy): {sc['offered_traj_per_s']:,.0f} trajectories/s. "
             f"A batch of {sc['budget_batch']:,} groups is the one whose staleness budget just covers the slots.\n\n")
    runs = ["| layout | batch (groups) | dataflow shards | trajectories/s | staleness: 0 / 1 / 2 / … | mean | dropped stale | slots busy "
            "| a version every | hub sends per version | a mirror sends per version | to every node |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lay in sc["layouts"] + sc["variants"]:
        u, f = lay["run"], lay["fanout"]
        top = max((int(k) for k in u["staleness"]), default=-1)
        lags = " / ".join(f"{100 * u['staleness'].get(str(k), 0):.0f}" for k in range(top + 1)) + " %" if top >= 0 else "none trained"
        every = f"{u['version_interval_s']:.1f} s" if u["version_interval_s"] else "none in the window"
        mirror = f"{f['leaf_copies']:,} copies, {gb(f['leaf_bytes'])}" if f["leaf_copies"] else "—"
        runs.append(f"| {lay['layout']} | {lay['groups_per_batch']:,} | {lay['dataflow_shards']} | {u['traj_per_s']:,.0f} | {lags} | "
                    f"{u['staleness_mean']:.2f} | {100 * u['dropped_share']:.1f} % | {100 * u['slot_util']:.0f} % | {every} | "
                    f"{f['hub_copies']:,} copies, {gb(f['hub_bytes'])} | {mirror} | "
                    f"{f['to_all_s']:,.1f} s |")
    tiers = ["| layout | tier | messages/s | egress | cores | needs |", "|---|---|---|---|---|---|"]
    for lay in sc["layouts"]:
        for t in lay["sizing"]:
            tiers.append(f"| {lay['layout']} | {t['tier']} | {t['msgs_per_s']:,.0f} | {t['egress_bytes_per_s'] / 1e9:,.2f} GB/s | "
                         f"{t['cores']:.1f} | {t['needs']} × {t['unit']} |")
    relayed = sc["layouts"][1]
    e = relayed["election"]
    return (provenance(r) + "Calibration:\n\n" + "\n".join(cal) + "\n\nThe fan-out against `benchmarks/results/fanout.json`:\n\n"
            + "\n".join(fan) + "\n\n" + pool + "\n" + setup + "\n".join(runs) + "\n\nWhat each tier needs at the simulated rate:\n\n"
            + "\n".join(tiers) + f"\n\nA cluster member leading the streams killed: {e['stall_s']:.1f} s stalled, "
            f"{e['versions']:.2f} of a version interval, about {e['trajectories']:,.0f} trajectories late ({relayed['layout']}).\n\n"
            f"![the pool model against the measured points, and staleness at scale]({r['figure']})\n")


def trl(r: dict[str, Any]) -> str:
    def f(v: float | None) -> str:
        return "–" if v is None else f"{v:.3f}"

    t = r["seconds"]
    rows = ["| side | samples/s trained | s/step | held-out v0 | at {:.0f} s | at {:.0f} s | mean, {:.0f}–{:.0f} s | at {:,} samples "
            "| cores busy |".format(t / 2, t, t / 2, t, r["results"][0]["equal_samples"]), "|---|---|---|---|---|---|---|---|---|"]
    for x in r["results"]:
        rows.append(f"| {x['side']} | {x['trained_per_s']:.0f} | {x['s_per_step']:.3f} | {f(x['held_out_v0'])} | "
                    f"{f(x['held_out_at_half'])} | {f(x['held_out_at_end'])} | {f(x['held_out_second_half'])} | "
                    f"{f(x['held_out_at_equal_samples'])} | {x['cores_busy']:.2f} |")
    up = r["results"][-1]
    roles = ", ".join(f"{k[4:]} {v:.2f}" for k, v in up.items() if k.startswith("cpu."))
    return (provenance(r) + "\n".join(rows) + f"\n\n`up` trains **{r['up_over_trl']:.2f}×** TRL's samples/s. Cores busy over the RL "
            f"window, by process: TRL's one process {r['results'][0]['cores_busy']:.2f}; `up` {roles}.\n\n"
            f"![held-out against wall time and samples, TRL against up]({r['figure']})\n")


def trl_seeds(r: dict[str, Any]) -> str:
    def est(e: list[float], digits: int = 3, sign: str = "") -> str:
        return f"{e[0]:{sign}.{digits}f} ± {e[1]:.{digits}f}"

    t, n = r["seconds"], len(r["seeds"])
    trl, up = r["sides"]["trl"], r["sides"]["up"]
    rows = [f"| side | samples/s trained | held-out at {t / 2:.0f} s | at {t:.0f} s | mean, {t / 2:.0f}–{t:.0f} s | at equal samples "
            "| cores busy |", "|---|---|---|---|---|---|---|"]
    for x in (trl, up):
        rows.append(f"| {x['side']} | {est(x['trained_per_s'], 0)} | {est(x['held_out_at_half'])} | {est(x['held_out_at_end'])} | "
                    f"{est(x['held_out_second_half'])} | {est(x['held_out_at_equal_samples'])} | {est(x['cores_busy'], 2)} |")
    times = ["| RL wall time (s) | " + " | ".join(f"{x['seconds']:.0f}" for x in r["at_times"]) + " |",
             "|---|" + "---|" * len(r["at_times"]),
             "| up − TRL, held-out | " + " | ".join(est(x["up_minus_trl"], 3, "+") for x in r["at_times"]) + " |"]
    ahead = "ahead at every tenth of the window" if r["ahead_throughout"] else "not ahead at every tenth of the window"
    return (provenance(r) + f"{n} seeds ({', '.join(map(str, r['seeds']))}), {t:.0f} s of RL each side per seed; mean ± 95 % t-interval "
            "over seeds.\n\n" + "\n".join(rows) + f"\n\n`up` trains **{est(r['up_over_trl'], 2)}×** TRL's samples/s; the plane (dataflow, "
            f"nats-server, launcher) takes {est([100 * x for x in up['plane_share'][:2]], 1)} % of its CPU. Held-out, "
            f"up − TRL paired by seed: {est(r['second_half_up_minus_trl'], 3, '+')} over the second half; {ahead} (the interval "
            "above zero):\n\n" + "\n".join(times) + f"\n\n![held-out over seeds, and up − TRL with its interval]({r['figure']})\n")


def plane_share(r: dict[str, Any]) -> str:
    roles = ("trainer-solver", "rollout-0", "evaluator", "dataflow", "nats-server", "launcher")
    rows = ["| width | parameters | samples/s trained | s/version | trainer outside its step | trainer waiting for a batch "
            "| delta a version | trainer | node | evaluator | dataflow | nats-server | launcher | the plane's share "
            "| plane CPU per 1k samples |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in r["widths"]:
        c, waits = w["cpu"], w.get("trainer_waits")
        rows.append(f"| {w['width']} | {w['parameters'] / 1e6:.2f} M | {w['trained_per_s']:.0f} | {w['s_per_version']:.3f} | "
                    f"{100 * w['outside_step']:.0f} % | {'–' if waits is None else f'{100 * waits:.0f} %'} | "
                    f"{(w['delta_bytes'] or 0) / 2**10:,.0f} KiB | "
                    + " | ".join(f"{c.get(k, 0.0):.3f}" for k in roles)
                    + f" | **{100 * w['plane_share']:.1f} %** | {w['plane_ms_per_1k_samples']:,.0f} ms |")
    return (provenance(r) + f"{r['seconds']:.0f} s of RL at each width, each from its own {r['widths'][0]['sft_steps']}-step SFT "
            "warm start; CPU in cores busy over the window.\n\n" + "\n".join(rows)
            + "\n\n![the plane's share and the trainer's time outside its step by model size](benchmarks/figures/plane_share.png)\n")


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "facade": facade, "fanout": fanout, "fanout_links": fanout_links, "moe": moe,
    "server_chaos": server_chaos, "partial_rollouts": partial_rollouts,
    "generation_stall": generation_stall, "house": house, "hostile_node": hostile_node, "lora": lora,
    "shared_base": shared_base, "lora_team": lora_team, "pool_model": pool_model, "pool_scale": pool_scale, "trl": trl,
    "trl_seeds": trl_seeds, "trl_seeds_sft1050": trl_seeds, "trl_seeds_sft1050_1core": trl_seeds,
    "trl_seeds_sft1050_2core": trl_seeds, "vllm_stall": vllm_stall,
    "vllm_partial": vllm_partial, "plane_share": plane_share,
}


def render(page: str) -> str:
    def section(m: re.Match[str]) -> str:
        name = m["name"]
        record = json.loads((RESULTS / f"{name}.json").read_text())
        return m.group(1) + "\n" + RENDERERS[name](record) + "\n" + m.group(4)

    return SECTION.sub(section, page)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="exit 1 if a rendered section is stale; change nothing")
    args = ap.parse_args()
    page = PAGE.read_text()
    fresh = render(page)
    if args.check:
        stale = [m["name"] for m, n in zip(SECTION.finditer(page), SECTION.finditer(fresh), strict=True) if m[0] != n[0]]
        if stale:
            print(f"BENCHMARKS.md is stale in: {', '.join(stale)} (python benchmarks/render.py)")
        return 1 if stale else 0
    PAGE.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
