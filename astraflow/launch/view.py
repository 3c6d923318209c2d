"""The live view of ``astraflow up``: a rich dashboard on a terminal, one short line every few seconds otherwise."""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live as RichLive
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from astraflow.config import Recipe
from astraflow.launch.watcher import STALE_BEATS, Live
from astraflow.streams.messages import HEARTBEAT_PERIOD_S, DataflowStats, TrainerStats

KEYS = ("tasks", "trajectories", "issued", "in_flight", "buffered", "batches", "reward_mean", "tokens_per_s", "wait_frac", "loss")
NO_NODE_HINT_S = 10.0
PLAIN_EVERY_S = 5.0


def refused(live: Live) -> str:
    """Trajectories the dataflow turned away, by check, the most frequent three (``refused 7,242: reward_claim 2,414, …``);
    "" when none. The dataflow counts them as ``invalid.{check}`` in its heartbeat."""
    counts: dict[str, float] = {}
    for hb, _ in live.beats.values():
        if isinstance(hb.stats, DataflowStats):
            for k, v in hb.stats.counters.items():
                if k.startswith("invalid.") and v:
                    counts[k.removeprefix("invalid.")] = counts.get(k.removeprefix("invalid."), 0) + v
    if not counts:
        return ""
    top = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:3])
    return f"refused {sum(counts.values()):,.0f}: {top}"


def quarantined(live: Live) -> str:
    """The nodes the dataflow cut off and why (``quarantined: evil (reward_claim ×2, prompt_claim ×1)``); "" when none."""
    if not live.quarantined:
        return ""
    return "quarantined: " + ", ".join(f"{n} ({q.summary()})" for n, q in sorted(live.quarantined.items()))


class View:
    def __init__(self, recipe: Recipe, console: Console, join_command: str) -> None:
        self.recipe, self.console, self.join_command = recipe, console, join_command
        self.steps = {p: c.trainer.steps for p, c in recipe.policies.items()}
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=console)
        self.bars = {p: self.progress.add_task(f"{p} versions", total=n) for p, n in self.steps.items()}
        self.rich = RichLive(console=console, refresh_per_second=2, transient=False) if console.is_terminal else None
        self._printed = 0.0
        self._started = self._nodes_seen = time.monotonic()
        self.warm_start_steps = max(c.sft.steps for c in recipe.policies.values())

    def __enter__(self) -> View:
        if self.rich:
            self.rich.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.rich:
            self.rich.stop()

    def note(self, text: str) -> None:
        """Something that happened (a restart, an autoscale action): printed above the dashboard."""
        self.console.print(text)

    def waiting_for(self, live: Live, local_nodes: int) -> str | None:
        """What the run waits for, if anything: the trainers' first version (and their warm start), the run's own nodes
        starting, or a node to join from elsewhere. ``local_nodes``: rollout processes of this ``up`` alive now."""
        now = time.monotonic()
        if live.nodes() > 0:
            self._nodes_seen = now
        ours = f"{local_nodes} rollout node{'s' if local_nodes != 1 else ''} of this run"
        starting = f"; {ours} start and wait for it" if local_nodes else ""
        if not live.versions:
            warming = {hb.policy: (hb.stats.warm_start_done, hb.stats.warm_start_steps) for hb in live.alive().values()
                       if isinstance(hb.stats, TrainerStats) and hb.stats.warm_start_steps}
            if warming:
                done = ", ".join(f"{p} {d}/{n}" for p, (d, n) in sorted(warming.items()))
                return f"waiting for v0: the warm start, SFT steps {done}{starting}"
            if self.warm_start_steps:
                warm = f"the trainer's warm start ({self.warm_start_steps} SFT steps) for {now - self._started:.0f} s"
                return f"waiting for v0: {warm}{starting}"
            return f"waiting for v0 from the trainer{starting}"
        if now - self._nodes_seen <= NO_NODE_HINT_S:
            return None
        if local_nodes:
            return f"waiting for {ours} to join (no heartbeat yet)"
        return f"no rollout node connected: nothing is generated. Join one with: {self.join_command}"

    def update(self, live: Live, restarts: dict[str, int], run_s: float, local_nodes: int = 0) -> None:
        for p, v in live.versions.items():
            if p in self.bars:
                self.progress.update(self.bars[p], completed=v)
        waiting = self.waiting_for(live, local_nodes)
        if self.rich:
            parts: list[Table | Progress | str] = [self.progress, self.table(live, restarts)]
            if waiting:
                parts.append(f"[yellow]{waiting}[/]")
            self.rich.update(Group(*parts))
        elif time.monotonic() - self._printed >= PLAIN_EVERY_S:
            self._printed = time.monotonic()
            self.console.print(self.line(live, restarts, run_s, waiting), soft_wrap=True)

    def line(self, live: Live, restarts: dict[str, int], run_s: float, waiting: str | None) -> str:
        """One short line (no growing dictionaries): versions, reward, nodes, rate, the last held-out, restarts."""
        vs = " ".join(f"{p} v{live.versions.get(p, 0)}/{n} r={live.rewards.get(p, float('nan')):.2f}" for p, n in self.steps.items())
        last_eval = max(live.evals) if live.evals else None
        held = f"held-out v{last_eval}={live.evals[last_eval]:.2f}" if last_eval is not None else "held-out -"
        restarted = ",".join(f"{n}={k}" for n, k in restarts.items() if k)
        text = f"[{run_s:7.1f}s] {vs} | nodes {live.nodes()} | {live.rate:.1f} traj/s | {held}"
        if restarted:
            text += f" | restarts {restarted}"
        if turned_away := refused(live):
            text += f" | {turned_away}"
        if cut_off := quarantined(live):
            text += f" | {cut_off}"
        if waiting:
            text += f" | {waiting}"
        return text

    def table(self, live: Live, restarts: dict[str, int]) -> Table:
        t = Table(title=f"AstraFlow · {self.recipe.name}", expand=False)
        for col in ("worker", "role", "pool / region", "version", "restarts", "stats"):
            t.add_column(col)
        now = time.monotonic()
        for wid, (hb, at) in sorted(live.beats.items()):
            age = now - at
            summary = hb.stats.summary()
            stats = " ".join(f"{k}={summary[k]:.3g}" for k in KEYS if k in summary)
            gone = age >= STALE_BEATS * HEARTBEAT_PERIOD_S
            if gone:
                stats = f"[dim]gone {age:.0f}s ago · last: {stats}[/]"
            where = "/".join(x for x in (hb.pool, hb.region) if x)
            t.add_row(wid, hb.role, where, str(hb.version), str(restarts.get(wid, "")), stats)
        evals = " ".join(f"v{v}={r:.2f}" for v, r in sorted(live.evals.items())[-4:])
        lag = " ".join(f"{k}={v}" for k, v in live.lags.items())
        advice = f"   autoscale target {live.advice.target} ({live.advice.action})" if live.advice else ""
        turned_away = refused(live)
        turned_away = f"   {turned_away}" if turned_away else ""
        cut_off = f"\n[bold red]{quarantined(live)}[/]" if live.quarantined else ""
        t.caption = f"{live.nodes()} nodes, {live.rate:.1f} traj/s   lag: {lag}   held-out: {evals or '-'}{advice}{turned_away}{cut_off}"
        return t
