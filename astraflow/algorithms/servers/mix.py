"""mix: fill each batch from several data sources in proportion to their weights.

A group's source is ``group.meta[meta_key]`` when the task carries that key, otherwise the
prompt id up to the first ``separator`` (``"math/0042"`` -> ``"math"``; an id without the
separator is its own source). The base server (fifo or edf) orders and drops as usual; mix
only decides how many groups each source contributes, by smooth weighted round robin:

    credit_s += n_groups * w_s / sum(w)         once per batch, for every weighted source
    repeat n_groups times:
        s = argmax credit_s over sources with weight > 0 that still have servable groups
            (ties: the order of ``weights``)
        take s's next group in base order;  credit_s -= 1

so over batches each source gets its share exactly, up to rounding carried as credit. When no
weighted source has groups left, the batch is filled from the rest (unweighted sources, or
weight 0) in base order. Credits are clamped to [-n_groups, n_groups]: a source that was starved,
or filled in for one, is caught up by at most one batch. The batch keeps base order.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from astraflow.algorithms.base import SERVERS, AlgoConfig, Server, ServeResult
from astraflow.algorithms.plugin import ServerPlugin
from astraflow.algorithms.servers.edf import EdfConfig
from astraflow.algorithms.servers.fifo import FifoConfig
from astraflow.algorithms.types import Context, Group


class MixConfig(AlgoConfig):
    type: Literal["mix"] = "mix"
    base: Annotated[FifoConfig | EdfConfig | ServerPlugin, Field(discriminator="type")] = FifoConfig()
    """The server that orders the buffer and drops stale groups (fifo, edf or a plug-in)."""
    weights: dict[str, float] = Field(min_length=1)
    """Share of each batch per source, e.g. {math: 3, code: 1} (normalised to sum 1)."""
    meta_key: str = "source"
    """Task metadata key that names a group's source."""
    separator: str = Field("/", min_length=1)
    """Without that key, the source is the prompt id up to the first separator."""

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, weights: dict[str, float]) -> dict[str, float]:
        if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"weights must be >= 0 with a positive sum, got {weights}")
        return weights


@SERVERS.register("mix", MixConfig)
class Mix(Server):
    name = "mix"

    def __init__(self, cfg: MixConfig, base: Server) -> None:
        self.cfg = cfg
        self.base = base
        self.credit: dict[str, float] = {s: 0.0 for s, w in cfg.weights.items() if w > 0}

    def source_of(self, group: Group) -> str:
        value = group.meta.get(self.cfg.meta_key)
        return str(value) if value is not None else group.prompt_id.partition(self.cfg.separator)[0]

    def order(
        self, buffer: Sequence[Group], ctx: Context, rng: random.Random
    ) -> tuple[list[Group], list[tuple[str, str]]]:
        return self.base.order(buffer, ctx, rng)

    def serve(self, buffer: Sequence[Group], n_groups: int, ctx: Context, rng: random.Random) -> ServeResult:
        ordered, dropped = self.base.order(buffer, ctx, rng)
        if n_groups <= 0 or len(ordered) < n_groups:
            return ServeResult([], [], dropped)
        queues: dict[str, deque[int]] = {s: deque() for s in self.credit}
        rest: list[int] = []  # positions of groups from unweighted sources
        for i, group in enumerate(ordered):
            source = self.source_of(group)
            if source in queues:
                queues[source].append(i)
            else:
                rest.append(i)
        total = sum(self.cfg.weights.values())
        credit = {s: c + n_groups * self.cfg.weights[s] / total for s, c in self.credit.items()}
        picked: list[int] = []
        for _ in range(n_groups):
            candidates = [s for s, q in queues.items() if q]
            if not candidates:
                break
            s = max(candidates, key=lambda s: credit[s])  # first of the ties, in weights order
            credit[s] -= 1.0
            picked.append(queues[s].popleft())
        if len(picked) < n_groups:  # weighted sources ran dry: fill in base order
            picked += sorted(rest + [i for q in queues.values() for i in q])[: n_groups - len(picked)]
        self.credit = {s: max(-n_groups, min(n_groups, c)) for s, c in credit.items()}
        batch = [ordered[i] for i in sorted(picked)]
        return ServeResult(batch, [g.task_id for g in batch], dropped)

    def state(self) -> dict[str, Any]:
        return {"credit": dict(self.credit), "base": self.base.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.credit = {s: float(state["credit"].get(s, 0.0)) for s in self.credit}
        self.base.load_state(state["base"])
