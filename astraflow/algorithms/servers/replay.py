"""replay: reuse recently served groups for a share of each batch.

Every batch has ``k = floor(ratio * n_groups)`` replayed groups (fewer while the replay memory
holds fewer valid ones) and ``n_groups - k`` fresh groups served by the base server. Replayed
groups stay in the replay memory, not in the buffer, so they are in ``batch`` but never in
``taken``. The memory holds the last ``capacity`` freshly served groups; each can be replayed at
most ``max_replays`` times. Before choosing, groups that are now stale or expired (the same
test as fifo/edf: ``versions[policy] - min_version > max_staleness``) leave the memory, so a
replayed sample never breaks the staleness bound. The ``k`` replayed groups are drawn
uniformly without replacement with the service's ``rng``, after the fresh part is known to fill
(an empty batch consumes no randomness and no replays). ``ratio < 1`` so the buffer drains.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field

from astraflow.algorithms.base import SERVERS, AlgoConfig, Server, ServeResult
from astraflow.algorithms.plugin import ServerPlugin
from astraflow.algorithms.servers.edf import EdfConfig
from astraflow.algorithms.servers.fifo import FifoConfig
from astraflow.algorithms.servers.mix import MixConfig
from astraflow.algorithms.types import Context, Group


class ReplayConfig(AlgoConfig):
    type: Literal["replay"] = "replay"
    base: Annotated[FifoConfig | EdfConfig | MixConfig | ServerPlugin, Field(discriminator="type")] = FifoConfig()
    """The server that picks the fresh part of each batch."""
    ratio: float = Field(0.25, ge=0.0, lt=1.0)
    """Share of each batch filled with replayed groups (rounded down)."""
    capacity: int = Field(256, ge=1)
    """How many recently served groups the replay memory keeps."""
    max_replays: int = Field(1, ge=1)
    """How many times one group may be replayed."""


@SERVERS.register("replay", ReplayConfig)
class Replay(Server):
    name = "replay"
    replays = True

    def __init__(self, cfg: ReplayConfig, base: Server) -> None:
        self.cfg = cfg
        self.base = base
        self.memory: list[tuple[Group, int]] = []  # (group, times replayed), oldest first

    def order(
        self, buffer: Sequence[Group], ctx: Context, rng: random.Random
    ) -> tuple[list[Group], list[tuple[str, str]]]:
        return self.base.order(buffer, ctx, rng)

    def serve(self, buffer: Sequence[Group], n_groups: int, ctx: Context, rng: random.Random) -> ServeResult:
        self.memory = [(g, n) for g, n in self.memory if ctx.invalid_reason(g) is None]
        k = min(int(self.cfg.ratio * n_groups), len(self.memory))
        fresh = self.base.serve(buffer, n_groups - k, ctx, rng)
        if not fresh.batch:
            return fresh
        chosen = set(rng.sample(range(len(self.memory)), k))
        replayed = [self.memory[i][0] for i in sorted(chosen)]
        memory = [(g, n + (i in chosen)) for i, (g, n) in enumerate(self.memory)]
        memory = [(g, n) for g, n in memory if n < self.cfg.max_replays] + [(g, 0) for g in fresh.batch]
        self.memory = memory[-self.cfg.capacity :]
        return ServeResult(fresh.batch + replayed, fresh.taken, fresh.dropped)

    def state(self) -> dict[str, Any]:
        return {"memory": [[g.to_dict(), n] for g, n in self.memory], "base": self.base.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.memory = [(Group.from_dict(g), int(n)) for g, n in state["memory"]]
        self.base.load_state(state["base"])
