"""Choosing data algorithms from YAML: one discriminated union per hook kind.

Each plug-in's config lives beside it (``curators/greso.py`` holds ``GresoConfig``); this
module lists them, so ``type: gresso`` or a misspelt field fails when the config is loaded,
with its location (``curators.0.greso.p_esay``) in the error. ``type: plugin`` loads a user
class by ``path`` (see ``plugin.py``). Keep these unions and the registries in ``__init__``
in step (a test checks).

    algorithms:
      curators: [{type: greso, target_easy: 0.1}]
      filters: [{type: reward_guard}, {type: dynamic_sampling}, {type: length, max_tokens: 4096}]
      server: {type: replay, ratio: 0.25, base: {type: edf}}
      advantage: {type: grpo, scale: none}
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from astraflow.algorithms.advantages.grpo import GrpoConfig
from astraflow.algorithms.advantages.none import NoneConfig
from astraflow.algorithms.advantages.rloo import RlooConfig
from astraflow.algorithms.curators.accept_all import AcceptAllConfig
from astraflow.algorithms.curators.curriculum import CurriculumConfig
from astraflow.algorithms.curators.filter_solved import FilterSolvedConfig
from astraflow.algorithms.curators.greso import GresoConfig
from astraflow.algorithms.filters.dynamic_sampling import DynamicSamplingConfig
from astraflow.algorithms.filters.length import LengthConfig
from astraflow.algorithms.filters.reward_guard import RewardGuardConfig
from astraflow.algorithms.filters.staleness import StalenessConfig
from astraflow.algorithms.plugin import AdvantagePlugin, CuratorPlugin, FilterPlugin, ServerPlugin
from astraflow.algorithms.servers.edf import EdfConfig
from astraflow.algorithms.servers.fifo import FifoConfig
from astraflow.algorithms.servers.mix import MixConfig
from astraflow.algorithms.servers.replay import ReplayConfig

CuratorConfig = Annotated[
    AcceptAllConfig | GresoConfig | CurriculumConfig | FilterSolvedConfig | CuratorPlugin,
    Field(discriminator="type"),
]
FilterConfig = Annotated[
    DynamicSamplingConfig | StalenessConfig | LengthConfig | RewardGuardConfig | FilterPlugin,
    Field(discriminator="type"),
]
ServerConfig = Annotated[
    FifoConfig | EdfConfig | ReplayConfig | MixConfig | ServerPlugin,
    Field(discriminator="type"),
]
AdvantageConfig = Annotated[
    GrpoConfig | RlooConfig | NoneConfig | AdvantagePlugin,
    Field(discriminator="type"),
]


class AlgorithmsConfig(BaseModel):
    """The data algorithms of one run (or one policy): what ``build_pipeline`` builds."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    curators: list[CuratorConfig] = [AcceptAllConfig()]
    """Before rollout, in order; the first that skips a prompt decides."""
    filters: list[FilterConfig] = []
    """After rollout, in order; the first that drops a group decides (its reason is counted)."""
    server: ServerConfig = FifoConfig()
    """How batches are taken from the buffer (replay and mix wrap a base server)."""
    advantage: AdvantageConfig = GrpoConfig()
    """Per-sample advantage within a group."""
