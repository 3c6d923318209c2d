"""The SFT warm start: the learning-rate warmup (a step during warmup moves the weights by lr · step / warmup_steps), and
the warm start of a base several policies share (train/base_warm_start.py)."""

from __future__ import annotations

import json

import pytest

from astraflow.config import SFTConfig, load_recipe, parse_recipe
from astraflow.models import build_model, load_tokenizer
from astraflow.tasks import Problem
from astraflow.train.sft import sft

TOK = load_tokenizer("byt5")
LR = 0.01


def largest_move(steps: int, warmup_steps: int) -> float:
    """The largest change of any weight over ``steps`` SFT steps. While the gradient keeps its sign, each AdamW step
    moves a weight by about its learning rate (m / √v ≈ ±1; weight decay adds lr · 0.01 · w), so this is about
    the sum of the steps' learning rates."""
    recipe = parse_recipe({"name": "s", "model": {"hidden_size": 32, "intermediate_size": 64}})
    model = build_model(recipe.policies["solver"].model, TOK)
    before = [p.detach().clone() for p in model.parameters()]
    sft(model, TOK, [Problem("p", "1+2=", {"answer": "3"})], SFTConfig(steps=steps, lr=LR, warmup_steps=warmup_steps, batch_size=2))
    return max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before, strict=True))


def test_without_warmup_every_step_takes_the_full_learning_rate():
    assert largest_move(1, 0) == pytest.approx(LR, rel=0.05)
    assert largest_move(2, 0) == pytest.approx(2 * LR, rel=0.05)


def test_warmup_rises_linearly_to_the_learning_rate():
    assert largest_move(2, 2) == pytest.approx(LR / 2 + LR, rel=0.05)
    assert largest_move(4, 4) == pytest.approx(LR * (1 + 2 + 3 + 4) / 4, rel=0.05)


def test_more_warmup_than_steps_fails_at_load_with_the_field_named():
    with pytest.raises(ValueError, match="sft.warmup_steps"):
        parse_recipe({"name": "s", "sft": {"steps": 10, "warmup_steps": 20}})
    assert parse_recipe({"name": "s", "sft": {"steps": 0, "warmup_steps": 20}})  # no warm start: nothing to warm up


def test_interleaved_warm_starts_are_spread_over_the_whole():
    from astraflow.train.sft import interleave

    order = interleave({"solver": 3, "verifier": 9})
    assert len(order) == 12 and order.count("solver") == 3
    for k in range(1, 13):  # every prefix holds each warm start's share of it, to a step
        assert abs(order[:k].count("solver") - 3 * k / 12) <= 1


def shared_recipe(**sft: object):
    lora = {"trainer": {"lora": {"rank": 2}}}
    return parse_recipe({"name": "s", "workflow": "solver_verifier", "reward": "math", "rollout": {"shared_base": True},
                         "model": {"hidden_size": 32, "intermediate_size": 64}, "data": {"max_operand": 9, "n_train": 20, "n_eval": 5},
                         "sft": {"steps": 3, "batch_size": 2, **sft},
                         "policies": {"solver": lora, "verifier": {**lora, "sft": {"steps": 2, "lr": 0.01}}}})


def test_a_shared_base_is_warm_started_once_and_every_policy_loads_it(tmp_path):
    """``rollout.shared_base``: the warm start trains the one base (every weight) on each policy's warm start; every
    role then loads it as ``model.pretrained`` without a warm start of its own; an unchanged recipe reuses it."""
    from astraflow.train.base_warm_start import on_base, warm_base
    from astraflow.weights.delta import state_digest, to_bf16_state

    recipe, out = shared_recipe(), tmp_path / "base"
    assert warm_base(recipe, out, threads=1)
    assert json.loads((out / "warm_start.json").read_text())["steps"] == {"solver": 3, "verifier": 2}
    assert not warm_base(recipe, out, threads=1)  # kept: the same model, data, warm starts and seed
    assert warm_base(shared_recipe(lr=0.001), out, threads=1)  # a changed warm start trains it again
    on = on_base(recipe, out)
    assert {p.model.pretrained for p in on.policies.values()} == {str(out.resolve())}
    assert all(p.sft.steps == 0 for p in on.policies.values())
    built = build_model(recipe.policies["solver"].model, TOK)
    loaded = build_model(on.policies["verifier"].model, TOK)
    assert state_digest(to_bf16_state(built.state_dict())) != state_digest(to_bf16_state(loaded.state_dict()))


async def test_a_trainer_on_a_shared_base_does_not_warm_start_alone():
    from astraflow.role import TrainerOptions
    from astraflow.streams.plane import NatsOptions
    from astraflow.train.worker import serve

    with pytest.raises(ValueError, match="astraflow warm-start"):
        await serve(shared_recipe(), TrainerOptions(nats=NatsOptions(url="nats://127.0.0.1:1"), run="r", worker_id="trainer-v",
                                                    policy="verifier"))


def test_up_warm_starts_a_shared_base_once_and_a_resumed_run_keeps_it(tmp_path):
    from astraflow.launch.rundir import RunDir
    from astraflow.launch.up import RunFailed, prepare

    rundir = RunDir(tmp_path / "run")
    written = prepare(shared_recipe(), rundir, resume=False)
    assert written.policies["solver"].model.pretrained == str(rundir.file("base").resolve())
    assert load_recipe(rundir.recipe) == written  # what every role reads
    made = (rundir.file("base") / "warm_start.json").stat().st_mtime_ns
    assert prepare(shared_recipe(), rundir, resume=True) == written  # the same warm start: the same base, kept
    assert (rundir.file("base") / "warm_start.json").stat().st_mtime_ns == made
    with pytest.raises(RunFailed, match="warm start changed"):  # its adapters were trained on the base it has
        prepare(shared_recipe(lr=0.001), rundir, resume=True)


def test_astraflow_warm_start_writes_the_base_a_recipe_shares(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from astraflow.cli import app

    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump(shared_recipe().model_dump(mode="json", by_alias=True)))
    done = CliRunner().invoke(app, ["warm-start", str(path), "--out", str(tmp_path / "base")])
    assert done.exit_code == 0, done.output
    assert json.loads((tmp_path / "base" / "warm_start.json").read_text())["steps"] == {"solver": 3, "verifier": 2}
    alone = CliRunner().invoke(app, ["warm-start", str(path), "--out", str(tmp_path / "b2"), "--set", "rollout.shared_base=false"])
    assert alone.exit_code == 2 and "shares no base" in alone.output and not (tmp_path / "b2").exists()
    (tmp_path / "models" / "mine").mkdir(parents=True)  # a directory of the user's: never replaced
    taken = CliRunner().invoke(app, ["warm-start", str(path), "--out", str(tmp_path / "models")])
    assert taken.exit_code == 2 and "holds files" in taken.output and (tmp_path / "models" / "mine").exists()


def test_a_node_without_the_shared_base_is_told_where_it_lies(tmp_path):
    """A role on another machine, handed the run's recipe, finds no ``base/`` there: it says so, not that the path is a
    malformed hub id."""
    from astraflow.config import ModelConfig
    from astraflow.models import model_limits

    missing = ModelConfig(pretrained=str(tmp_path / "run" / "base"))
    for make in (lambda: build_model(missing, TOK), lambda: model_limits(missing)):
        with pytest.raises(FileNotFoundError, match="model.pretrained .* no such directory on this machine"):
            make()
