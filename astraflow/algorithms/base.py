"""The four hooks a data algorithm can fill, each a base class whose hooks do nothing.

Where each runs in the dataflow service:

- ``Curator.select`` before a prompt is published as a task; ``Curator.observe`` once its
  group is complete (feedback for the next selection).
- ``Filter.keep`` when a group is complete, before it enters the serving buffer.
- ``Server.serve`` when the trainer needs a batch: picks groups from the buffer.
- ``Advantage.compute`` on each group of a served batch.

Every plug-in carries ``state()`` (JSON-serialisable) and ``load_state()`` so the service can
store it in the run's KV bucket and a restarted dataflow continues exactly where it stopped.
Plug-ins are pure: no I/O, no clocks (time comes in ``Context.now``), no global randomness
(the service passes a ``random.Random``).

Each hook kind has a registry (``CURATORS``, ``FILTERS``, ``SERVERS``, ``ADVANTAGES``): a plug-in
registers its class with its config, ``@CURATORS.register("greso", GresoConfig)``, and is built as
``Class(config)``; a package outside the repository adds one through an entry point in the group
``astraflow.curator`` (``filter``, ``server``, ``advantage``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from astraflow.algorithms.types import KEEP, Context, Decision, Group, PromptItem
from astraflow.registry import Registry


class AlgoConfig(BaseModel):
    """Base of every plug-in's config: strict, immutable, field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Plugin:
    """What every hook kind shares: a registry name and (empty) state."""

    name: ClassVar[str] = ""

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        del state


class Curator(Plugin):
    """Before rollout: decide whether a prompt is worth rolling out now."""

    def select(self, prompt: PromptItem, ctx: Context, rng: random.Random) -> Decision:
        return KEEP

    def observe(self, group: Group, ctx: Context) -> None:
        """Feedback: the group of a prompt this curator let through has completed."""


class Filter(Plugin):
    """After rollout: decide whether a completed group may be trained on."""

    def keep(self, group: Group, ctx: Context) -> Decision:
        return KEEP


@dataclass(slots=True)
class ServeResult:
    """What one ``Server.serve`` call did to the buffer.

    ``batch`` is either exactly ``n_groups`` long or empty (the buffer cannot fill a batch yet).
    ``taken`` lists the task ids of batch groups that leave the buffer; a replayed group is in
    ``batch`` but not in ``taken``. ``dropped`` lists groups that leave the buffer untrained,
    with the reason (``"stale"``, ``"expired"``, …); drops happen even when ``batch`` is empty.
    """

    batch: list[Group] = field(default_factory=list)
    taken: list[str] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)


class Server(Plugin):
    """Batch serving: order the buffer, drop what may no longer be trained, take a batch.

    Ordering servers (FIFO, EDF) override ``order``; wrappers (replay, mix) override ``serve``
    and ask their base for its ``order``. The default is buffer order with no drops.

    ``replays``: ``serve`` may hand out groups that are no longer in the buffer (served before).
    Only then does the dataflow remember the log positions of batched groups, and persist them,
    so that a restarted dataflow can still name the groups a replay memory holds; a server that
    replays without saying so has its replayed groups left out (counted ``replay_missing``).
    """

    replays: ClassVar[bool] = False

    def order(
        self, buffer: Sequence[Group], ctx: Context, rng: random.Random
    ) -> tuple[list[Group], list[tuple[str, str]]]:
        """The servable groups, best first, and the ``(task_id, reason)`` of those to drop."""
        return list(buffer), []

    def serve(self, buffer: Sequence[Group], n_groups: int, ctx: Context, rng: random.Random) -> ServeResult:
        ordered, dropped = self.order(buffer, ctx, rng)
        return take(ordered, n_groups, dropped)


class Advantage(Plugin):
    """Credit assignment: one scalar advantage per sample of a group."""

    def compute(self, group: Group) -> list[float]:
        return [0.0] * len(group.samples)



CURATORS: Registry[type[Curator]] = Registry("curator", "astraflow.algorithms")
FILTERS: Registry[type[Filter]] = Registry("filter", "astraflow.algorithms")
SERVERS: Registry[type[Server]] = Registry("server", "astraflow.algorithms")
ADVANTAGES: Registry[type[Advantage]] = Registry("advantage", "astraflow.algorithms")

def take(ordered: Sequence[Group], n_groups: int, dropped: list[tuple[str, str]]) -> ServeResult:
    """The first ``n_groups`` of ``ordered`` as a batch, or an empty batch if there are fewer."""
    if n_groups <= 0 or len(ordered) < n_groups:
        return ServeResult([], [], dropped)
    batch = list(ordered[:n_groups])
    return ServeResult(batch, [g.task_id for g in batch], dropped)


def finite_rewards(group: Group) -> list[float]:
    """The rewards as floats; raises if any is missing or not finite (advantages need all). The
    dataflow never lets such a group get here (it validates every trajectory and settles a group
    with an explicitly failed sample); this guards plug-ins used on their own."""
    rewards = list(group.rewards)
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(
            f"group {group.task_id!r} has a missing or non-finite reward {rewards}; "
            "the dataflow's validation admits none: compute advantages only on validated groups"
        )
    return rewards
