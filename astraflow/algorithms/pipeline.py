"""The composed data algorithms of a run, applied in the order the service needs them."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from astraflow.algorithms.base import Advantage, Curator, Filter, Plugin, Server, ServeResult
from astraflow.algorithms.types import KEEP, Context, Decision, Group, PromptItem


def label(plugin: Plugin) -> str:
    """A plug-in's registry name, or ``module:Class`` for a user plug-in without one."""
    cls = type(plugin)
    return plugin.name or f"{cls.__module__}:{cls.__qualname__}"


class Pipeline:
    """Curators (first skip wins), filters (first drop wins), a server and an advantage."""

    def __init__(
        self, curators: Sequence[Curator], filters: Sequence[Filter], server: Server, advantage: Advantage
    ) -> None:
        self.curators = list(curators)
        self.filters = list(filters)
        self.server = server
        self.advantage = advantage

    def select(self, prompt: PromptItem, ctx: Context, rng: random.Random) -> Decision:
        """Before rollout. Curators after the first that skips are not asked."""
        for curator in self.curators:
            decision = curator.select(prompt, ctx, rng)
            if not decision.keep:
                return decision
        return KEEP

    def observe(self, group: Group, ctx: Context) -> None:
        """A prompt's group completed (call before ``keep``: curators learn from dropped groups too)."""
        for curator in self.curators:
            curator.observe(group, ctx)

    def keep(self, group: Group, ctx: Context) -> Decision:
        """After rollout. Filters after the first that drops are not asked."""
        for f in self.filters:
            decision = f.keep(group, ctx)
            if not decision.keep:
                return decision
        return KEEP

    def serve(self, buffer: Sequence[Group], n_groups: int, ctx: Context, rng: random.Random) -> ServeResult:
        return self.server.serve(buffer, n_groups, ctx, rng)

    def advantages(self, group: Group) -> list[float]:
        values = self.advantage.compute(group)
        if len(values) != len(group.samples):
            raise ValueError(
                f"advantage {label(self.advantage)} returned {len(values)} values "
                f"for the {len(group.samples)} samples of group {group.task_id!r}"
            )
        return values

    def _slots(self) -> dict[str, list[Plugin]]:
        return {
            "curators": list(self.curators),
            "filters": list(self.filters),
            "server": [self.server],
            "advantage": [self.advantage],
        }

    def state(self) -> dict[str, Any]:
        """Every plug-in's state, tagged with its name (JSON-serialisable)."""
        return {
            slot: [{"name": label(p), "state": p.state()} for p in plugins] for slot, plugins in self._slots().items()
        }

    def load_state(self, state: dict[str, Any]) -> list[str]:
        """Restore what ``state()`` saved; returns the plug-ins that start fresh instead.

        A saved entry is restored only onto the plug-in at the same position with the same
        name, so a changed config never feeds one plug-in another's state; the plug-ins named in
        the returned list (``"filters[1]:length"``) had no matching entry.
        """
        fresh: list[str] = []
        for slot, plugins in self._slots().items():
            saved = state.get(slot, [])
            for i, plugin in enumerate(plugins):
                if i < len(saved) and saved[i].get("name") == label(plugin):
                    plugin.load_state(saved[i]["state"])
                else:
                    fresh.append(f"{slot}[{i}]:{label(plugin)}")
        return fresh
