"""Choosing data algorithms from YAML: one discriminated union per hook kind, open to its registry.

Each plug-in's config lives beside it (``curators/greso.py`` holds ``GresoConfig``); this
module lists the built-in ones, so a misspelt field fails when the config is loaded, with its
location (``curators.0.greso.p_esay``) in the error. Any other ``type`` is looked up in the hook
kind's registry (``base.CURATORS``: a package's entry point in the group ``astraflow.curator``
registers more), so ``type: gresso`` fails at load naming the registered ones. ``type: plugin``
loads a user class by ``path`` (see ``plugin.py``). Keep these unions and the registries in
step (a test checks).

    algorithms:
      curators: [{type: greso, target_easy: 0.1}]
      filters: [{type: reward_guard}, {type: dynamic_sampling}, {type: length, max_tokens: 4096}]
      server: {type: replay, ratio: 0.25, base: {type: edf}}
      advantage: {type: grpo, scale: none}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, get_args

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidatorFunctionWrapHandler, WrapValidator

from astraflow.algorithms.advantages.grpo import GrpoConfig
from astraflow.algorithms.advantages.none import NoneConfig
from astraflow.algorithms.advantages.rloo import RlooConfig
from astraflow.algorithms.base import ADVANTAGES, CURATORS, FILTERS, SERVERS
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
from astraflow.registry import Registry, type_name


def _or_registered(registry: Registry[Any], union: Any) -> WrapValidator:
    """A member of ``union`` validates through it (its errors name the member); any other ``type`` through ``registry``."""
    tags = {type_name(member) for member in get_args(union)}

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        tag = value.get("type") if isinstance(value, Mapping) else getattr(value, "type", None)
        return handler(value) if tag in tags or not isinstance(tag, str) else registry.parse(value)

    return WrapValidator(validate)


_Curators = AcceptAllConfig | GresoConfig | CurriculumConfig | FilterSolvedConfig | CuratorPlugin
CuratorConfig = Annotated[_Curators, Field(discriminator="type"), _or_registered(CURATORS, _Curators), SerializeAsAny()]
_Filters = DynamicSamplingConfig | StalenessConfig | LengthConfig | RewardGuardConfig | FilterPlugin
FilterConfig = Annotated[_Filters, Field(discriminator="type"), _or_registered(FILTERS, _Filters), SerializeAsAny()]
_Servers = FifoConfig | EdfConfig | ReplayConfig | MixConfig | ServerPlugin
ServerConfig = Annotated[_Servers, Field(discriminator="type"), _or_registered(SERVERS, _Servers), SerializeAsAny()]
_Advantages = GrpoConfig | RlooConfig | NoneConfig | AdvantagePlugin
AdvantageConfig = Annotated[_Advantages, Field(discriminator="type"), _or_registered(ADVANTAGES, _Advantages), SerializeAsAny()]


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
