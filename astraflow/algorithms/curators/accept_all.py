"""accept_all: roll out every prompt (the default curator)."""

from __future__ import annotations

from typing import Literal

from astraflow.algorithms.base import CURATORS, AlgoConfig, Curator


class AcceptAllConfig(AlgoConfig):
    type: Literal["accept_all"] = "accept_all"


@CURATORS.register("accept_all", AcceptAllConfig)
class AcceptAll(Curator):
    """Keeps every prompt; the base class's hooks already do exactly that."""

    name = "accept_all"

    def __init__(self, cfg: AcceptAllConfig | None = None) -> None:
        self.cfg = cfg or AcceptAllConfig()
