"""The run's summary as people read it: the headline figures, each policy, the task accounting, and CPU per role.

``summary.json`` keeps every figure in full; these tables show them rounded, with units, in words.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table


def duration(seconds: float) -> str:
    """37.1 s, 4 min 05 s, 1 h 02 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def size(n: float) -> str:
    """Bytes in binary units: 230166 -> 224.8 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def held_out(rewards: dict[str, float]) -> str:
    """first → last evaluated version, and the best one when it is neither: '0.510 (v0) → 0.600 (v80), best 0.730 (v70)'."""
    if not rewards:
        return "not evaluated"
    by_version = sorted((int(v), r) for v, r in rewards.items())
    (v0, r0), (vn, rn) = by_version[0], by_version[-1]
    text = f"{r0:.3f} (v{v0})" if v0 == vn else f"{r0:.3f} (v{v0}) → {rn:.3f} (v{vn})"
    vb, rb = max(by_version, key=lambda vr: vr[1])
    return text + (f", best {rb:.3f} (v{vb})" if vb not in (v0, vn) and rb > max(r0, rn) else "")


def headline(summary: dict[str, Any]) -> Table:
    t = Table(title=f"{summary['recipe']}: {summary['outcome']} in {duration(summary['wall_s'])}", show_header=False)
    t.add_column("figure", style="bold")
    t.add_column("value")
    t.add_row(f"held-out reward ({summary['eval_policy']})", held_out(summary["held_out_reward"]))
    for subject, rows in summary["held_out_others"].items():
        t.add_row(f"held-out reward ({subject})", held_out({v: r["reward"] for v, r in rows.items()}))
    if skipped := summary.get("evals_skipped"):
        t.add_row("evaluations skipped", "; ".join(f"{what}: {why}" for what, why in skipped.items()))
    wall = max(summary["wall_s"], 1e-9)
    t.add_row("samples generated", f"{summary['samples']:,} ({summary['samples'] / wall:.1f} per second of wall time)")
    restarts = ", ".join(f"{role} ×{n}" for role, n in sorted(summary["restarts"].items())) or "none"
    t.add_row("sessions · restarts", f"{summary['sessions']} · {restarts}")
    if warm := summary.get("base_warm_start"):
        t.add_row("shared base warm start", f"{' + '.join(f'{n} {p}' for p, n in warm['steps'].items())} steps in {warm['seconds']:.0f} s "
                  f"on {warm['threads']} threads, before the roles started (not in the wall time)")
    for name, p in summary["policies"].items():
        t.add_row(f"policy {name}", f"{p['versions']} versions for {p['steps']} steps · train reward {p['train_reward_last5']:.3f} "
                  f"(last 5) · keyframe {size(p['keyframe_bytes'])} · delta {size(p['delta_bytes_mean'])} (mean)")
    for name, acc in summary["accounting"].items():
        t.add_row(f"tasks of {name}", accounting(acc))
    return t


def accounting(acc: dict[str, Any]) -> str:
    """'684 issued: 640 trained, 12 dropped:stale, 16 buffered, 16 awaiting training; adds up'."""
    parts = [f"{n:,} {fate}" for fate, n in sorted(acc.get("fates", {}).items(), key=lambda kv: -kv[1])]
    parts += [f"{acc[k]:,} {name}" for k, name in (("buffered", "buffered"), ("awaiting", "awaiting training"),
                                                    ("in_flight", "in flight")) if acc.get(k)]
    verdict = "adds up" if acc.get("adds_up") else "[red]does not add up[/]"
    return f"{acc.get('total', 0):,} {acc.get('basis', 'issued')}: {', '.join(parts) or 'none settled'}; {verdict}"


def cpu_table(summary: dict[str, Any]) -> Table | None:
    cpu: dict[str, float] = summary["cpu_s"]
    if not cpu:
        return None  # a session whose launcher was killed recorded none
    total = sum(cpu.values())
    t = Table(title=f"CPU per process ({total / max(summary['wall_s'], 1e-9):.2f} cores busy on average)")
    for col in ("process", "CPU s", "share", "per 64 samples"):
        t.add_column(col, justify="left" if col == "process" else "right")
    per64 = summary["cpu_s_per_64_samples"]
    for name, s in sorted(cpu.items(), key=lambda kv: -kv[1]):
        t.add_row(name, f"{s:.1f}", f"{100 * s / max(total, 1e-9):.0f} %", f"{per64[name]:.3f} s" if name in per64 else "-")
    return t


def summary_tables(summary: dict[str, Any]) -> list[Table]:
    return [t for t in (headline(summary), cpu_table(summary)) if t is not None]
