"""A package outside the repository plugs in through an entry point in the group ``astraflow.<kind>``:
installed here for real (a ``*.dist-info`` with ``entry_points.txt`` and a module, on ``sys.path``)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from astraflow.algorithms import AlgorithmsConfig, build_pipeline
from astraflow.algorithms.base import CURATORS
from astraflow.registry import ENGINES, Registry, UnknownName
from astraflow.rollout.rewards import REWARDS, get_reward

PACKAGE = '''
from typing import Literal

from astraflow.algorithms.base import CURATORS, AlgoConfig, Curator
from astraflow.registry import ENGINES, Options


def shout(text, meta):  # a plain reward: registered under its entry point's name
    return float(text.isupper())


class EchoOptions(Options):
    type: Literal["far_echo"] = "far_echo"
    repeat: int = 2


@ENGINES.register("far_echo", EchoOptions)
def build_echo(options, model_cfg, rollout_cfg, tokenizer):
    raise NotImplementedError


class EveryOtherConfig(AlgoConfig):
    type: Literal["every_other"] = "every_other"
    start: int = 0
    """First prompt kept."""


@CURATORS.register("every_other", EveryOtherConfig)
class EveryOther(Curator):
    name = "every_other"

    def __init__(self, cfg):
        self.cfg = cfg
'''


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``astraflow_far`` installed: its module and its distribution's metadata, found through ``sys.path``."""
    (tmp_path / "astraflow_far.py").write_text(PACKAGE)
    info = tmp_path / "astraflow_far-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: astraflow-far\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [astraflow.reward]
        shout = astraflow_far:shout

        [astraflow.engine]
        far_echo = astraflow_far:build_echo

        [astraflow.curator]
        every_other = astraflow_far:EveryOther
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for registry, name in ((REWARDS, "shout"), (ENGINES, "far_echo"), (CURATORS, "every_other")):
        registry.unregister(name)
    sys.modules.pop("astraflow_far", None)


def test_an_entry_point_names_a_part_before_it_is_loaded_and_resolves_when_asked(installed: None):
    assert "shout" in REWARDS.names() and "astraflow_far" not in sys.modules
    assert get_reward("shout")("YES", {}) == 1.0
    assert ENGINES.parse({"type": "far_echo", "repeat": 3}).repeat == 3  # its option model, checked like a built-in's
    with pytest.raises(ValueError, match="not an option of engine far_echo"):
        ENGINES.parse({"type": "far_echo", "latency_sigma": 1.0})


def test_an_entry_point_algorithm_is_chosen_from_yaml(installed: None):
    cfg = AlgorithmsConfig.model_validate({"curators": [{"type": "every_other", "start": 1}]})
    pipeline = build_pipeline(cfg)
    assert type(pipeline.curators[0]).__name__ == "EveryOther" and pipeline.curators[0].cfg.start == 1


def test_an_unknown_name_is_one_error_naming_the_registered_ones_and_how_to_add_more(installed: None):
    for registry, known in ((REWARDS, "arithmetic, code"), (ENGINES, "far_echo, hf"), (CURATORS, "accept_all")):
        with pytest.raises(UnknownName) as err:
            registry.get("nope")
        assert isinstance(err.value, ValueError) and err.value.registered == registry.names()
        assert known in str(err.value) and f"an entry point in group astraflow.{registry.kind}" in str(err.value)
    with pytest.raises(UnknownName, match="a plug-in module listed in rollout.plugins or an entry point"):
        get_reward("nope")


def test_an_entry_point_that_does_not_import_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    info = tmp_path / "broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[astraflow.gadget]\nbent = no_such_module_here:thing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    gadgets: Registry[Any] = Registry("gadget")
    assert gadgets.names() == ["bent"]
    with pytest.raises(ValueError, match="gadget 'bent': cannot load entry point 'no_such_module_here:thing'"):
        gadgets.get("bent")
