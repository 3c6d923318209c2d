"""trainer.threads: auto takes the cores the other roles of ``astraflow up`` leave free; sft.threads: auto takes them all."""

from __future__ import annotations

import pytest

from astraflow.config import parse_recipe
from astraflow.train.threads import sft_threads, threads_for, trainer_threads, usable_cores, with_thread_counts


def test_auto_shares_what_the_nodes_and_the_evaluator_leave():
    recipe = parse_recipe({"name": "t", "rollout": {"nodes": 2, "threads": 2}})  # evaluator on by default
    assert trainer_threads(recipe, cores=16) == {"solver": 16 - 3 * 2}
    assert trainer_threads(recipe, cores=4) == {"solver": 1}  # never below one
    two = parse_recipe({"name": "t", "policies": ["solver", "verifier"], "rollout": {"nodes": 1}, "eval": {"enabled": False}})
    assert trainer_threads(two, cores=9) == {"solver": 4, "verifier": 4}


def test_a_fixed_count_is_kept_and_counted():
    recipe = parse_recipe({"name": "t", "policies": {"solver": {}, "verifier": {"trainer": {"threads": 3}}}, "rollout": {"nodes": 1},
                           "eval": {"enabled": False}})
    resolved = with_thread_counts(recipe, cores=8)
    assert resolved.policies["verifier"].trainer.threads == 3
    assert resolved.policies["solver"].trainer.threads == 8 - 1 - 3


def test_the_warm_starts_share_every_core_before_version_0():
    recipe = parse_recipe({"name": "t", "policies": {"solver": {"sft": {"steps": 5}}, "verifier": {"sft": {"steps": 5}}, "critic": {}},
                           "rollout": {"nodes": 2}})
    assert sft_threads(recipe, cores=9) == {"solver": 4, "verifier": 4}  # the critic does not warm-start
    resolved = with_thread_counts(recipe, cores=2)
    assert resolved.policies["solver"].sft.threads == 1 and resolved.policies["solver"].trainer.threads == 1
    one = with_thread_counts(parse_recipe({"name": "t", "sft": {"steps": 5}, "rollout": {"nodes": 2}}), cores=2)
    assert one.policies["solver"].sft.threads == 2 and one.policies["solver"].trainer.threads == 1
    fixed = parse_recipe({"name": "t", "sft": {"steps": 5, "threads": 3}})
    assert with_thread_counts(fixed, cores=8).policies["solver"].sft.threads == 3


def test_alone_a_trainer_takes_its_usable_cores(monkeypatch: pytest.MonkeyPatch):
    assert threads_for(5) == 5
    assert threads_for("auto") == usable_cores()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(usable_cores() * 4))
    assert threads_for("auto") == 1


def test_a_bad_count_fails_at_load_with_the_field_named():
    with pytest.raises(ValueError, match="threads"):
        parse_recipe({"name": "t", "trainer": {"threads": 0}})
    with pytest.raises(ValueError, match="threads"):
        parse_recipe({"name": "t", "sft": {"threads": 0}})
