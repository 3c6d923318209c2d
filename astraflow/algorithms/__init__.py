"""Data algorithms: pure, I/O-free plug-ins the dataflow service applies to RL data.

One module per algorithm, a base class and a registry per hook kind (``base``) and a config
union per hook kind (``config``). The service builds a
``Pipeline`` from ``AlgorithmsConfig`` and, per policy:

    d = pipeline.select(PromptItem(...), ctx, rng)      # before publishing a task; skip if not d.keep
    pipeline.observe(group, ctx)                         # every completed group, filtered or not
    d = pipeline.keep(group, ctx)                        # into the buffer, or count d.reason
    r = pipeline.serve(buffer, n_groups, ctx, rng)       # remove r.taken and r.dropped; train r.batch
    adv = pipeline.advantages(group)                     # for each group of r.batch
    kv.put(pipeline.state()) / pipeline.load_state(...)  # JSON, survives restarts
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

from astraflow.algorithms.advantages.grpo import Grpo, GrpoConfig
from astraflow.algorithms.advantages.none import NoneConfig, RawReward
from astraflow.algorithms.advantages.rloo import Rloo, RlooConfig
from astraflow.algorithms.base import (
    ADVANTAGES,
    CURATORS,
    FILTERS,
    SERVERS,
    Advantage,
    AlgoConfig,
    Curator,
    Filter,
    Plugin,
    Server,
    ServeResult,
)
from astraflow.algorithms.config import (
    AdvantageConfig,
    AlgorithmsConfig,
    CuratorConfig,
    FilterConfig,
    ServerConfig,
)
from astraflow.algorithms.curators.accept_all import AcceptAll, AcceptAllConfig
from astraflow.algorithms.curators.curriculum import Curriculum, CurriculumConfig
from astraflow.algorithms.curators.filter_solved import FilterSolved, FilterSolvedConfig
from astraflow.algorithms.curators.greso import Greso, GresoConfig
from astraflow.algorithms.filters.dynamic_sampling import DynamicSampling, DynamicSamplingConfig
from astraflow.algorithms.filters.length import Length, LengthConfig
from astraflow.algorithms.filters.reward_guard import RewardGuard, RewardGuardConfig
from astraflow.algorithms.filters.staleness import Staleness, StalenessConfig
from astraflow.algorithms.pipeline import Pipeline
from astraflow.algorithms.plugin import PluginConfig, load_class
from astraflow.algorithms.servers.edf import Edf, EdfConfig
from astraflow.algorithms.servers.fifo import Fifo, FifoConfig
from astraflow.algorithms.servers.mix import Mix, MixConfig
from astraflow.algorithms.servers.replay import Replay, ReplayConfig
from astraflow.algorithms.types import Context, Decision, Group, PromptItem, Sample
from astraflow.registry import Registry

P = TypeVar("P", bound=Plugin)


def build(cfg: AlgoConfig, registry: Registry[type[P]]) -> P:
    """One plug-in from its config; a config with a ``base`` (replay, mix) gets it built first."""
    if isinstance(cfg, PluginConfig):
        return cast(P, cfg.build())  # the config checked the class against its hook kind
    factory: Callable[..., P] = registry.get(getattr(cfg, "type"))  # noqa: B009 (every member of the union but PluginConfig has one)
    base = getattr(cfg, "base", None)
    return factory(cfg) if base is None else factory(cfg, build(base, registry))


def build_pipeline(cfg: AlgorithmsConfig) -> Pipeline:
    return Pipeline(
        curators=[build(c, CURATORS) for c in cfg.curators],
        filters=[build(f, FILTERS) for f in cfg.filters],
        server=build(cfg.server, SERVERS),
        advantage=build(cfg.advantage, ADVANTAGES),
    )


__all__ = [
    "ADVANTAGES",
    "CURATORS",
    "FILTERS",
    "SERVERS",
    "AcceptAll",
    "AcceptAllConfig",
    "Advantage",
    "AdvantageConfig",
    "AlgoConfig",
    "AlgorithmsConfig",
    "Context",
    "Curator",
    "CuratorConfig",
    "Curriculum",
    "CurriculumConfig",
    "Decision",
    "DynamicSampling",
    "DynamicSamplingConfig",
    "Edf",
    "EdfConfig",
    "Fifo",
    "FifoConfig",
    "Filter",
    "FilterConfig",
    "FilterSolved",
    "FilterSolvedConfig",
    "Greso",
    "GresoConfig",
    "Group",
    "Grpo",
    "GrpoConfig",
    "Length",
    "LengthConfig",
    "Mix",
    "MixConfig",
    "NoneConfig",
    "Pipeline",
    "Plugin",
    "PluginConfig",
    "PromptItem",
    "RawReward",
    "Replay",
    "ReplayConfig",
    "RewardGuard",
    "RewardGuardConfig",
    "Rloo",
    "RlooConfig",
    "Sample",
    "ServeResult",
    "Server",
    "ServerConfig",
    "Staleness",
    "StalenessConfig",
    "build",
    "build_pipeline",
    "load_class",
]
