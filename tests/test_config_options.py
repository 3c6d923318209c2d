"""Engine, workflow and loss options: chosen by ``type`` from registries, open to plug-ins, checked at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from astraflow.config import RecipeError, dump_recipe, load_recipe, parse_recipe
from astraflow.models import build_model, load_tokenizer
from astraflow.registry import BACKENDS, ENGINES, WORKFLOWS
from astraflow.rollout.engines.base import GenerationRequest, checked_engine
from astraflow.rollout.engines.registry import build_engine
from astraflow.rollout.workflows.registry import check_policies, evaluation_of
from astraflow.tasks import load_split
from astraflow.train.synthetic import sample_batches
from astraflow.train.torch_backend import TorchBackend

PLUGIN = Path(__file__).resolve().parent / "plugin_parts.py"
MODEL = {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}


def fails(recipe: dict, *lines: str) -> None:
    with pytest.raises(RecipeError) as err:
        parse_recipe({"name": "t", **recipe})
    for line in lines:
        assert line in str(err.value), str(err.value)


def test_a_field_of_another_engine_fails_at_load_with_the_field_named():
    fails({"rollout": {"engine": {"type": "hf", "latency_sigma": 2.0}}},
          "rollout.engine.latency_sigma: not an option of engine hf (it is an option of scripted)")
    fails({"rollout": {"engine": {"type": "scripted", "latency": "constant", "latency_sigma": 2.0}}},
          "rollout.engine: Value error, latency_sigma applies to latency: lognormal only")
    fails({"rollout": {"engine": {"type": "vllm", "mode": "inprocess", "url": "http://h:1"}}}, "url applies to mode: server only")


def test_a_field_of_another_loss_fails_at_load_with_the_field_named():
    fails({"trainer": {"loss": {"type": "ppo", "tau": 0.01}}}, "trainer.loss.tau: not an option of loss ppo (it is an option of m2po)")
    fails({"policies": {"solver": {"trainer": {"loss": {"type": "m2po", "clip_low": 0.1}}}}},
          "policies.solver.trainer.loss.clip_low: not an option of loss m2po (it is an option of decoupled_ppo, ppo)")
    fails({"trainer": {"loss": {"type": "m2po", "tau": 0}}}, "trainer.loss.tau: Input should be greater than 0")


def test_workflow_options_are_checked_at_load():
    fails({"workflow": {"type": "single_turn", "max_turns": 3}}, "workflow.max_turns: not an option of workflow single_turn")
    fails({"workflow": "env_http"}, "workflow.url: Field required")
    fails({"workflow": {"type": "openai_agent", "agent": "no_colon"}}, "workflow.agent: Value error, agent 'no_colon' must look like")


def test_unknown_types_fail_at_load_naming_the_registered_ones():
    fails({"rollout": {"engine": "tgi"}}, "rollout.engine: Value error, unknown engine 'tgi'; registered:", "hf, scripted, sglang, vllm")
    fails({"workflow": {"type": "debate"}}, "workflow: Value error, unknown workflow 'debate'", "single_turn")
    fails({"trainer": {"loss": "grpo"}}, "trainer.loss: Value error, unknown loss 'grpo'", "decoupled_ppo, m2po, ppo")
    fails({"rollout": {"engine": {"repeat": 2}}}, "rollout.engine.repeat: not an option of engine hf")  # no type: the default's
    fails({"rollout": {"engine": 7}}, "rollout.engine: Value error, the engine must be a name or a mapping with a type")
    fails({"rollout": {"plugins": ["no_such_plugin_module"]}}, "rollout.plugins: Value error, cannot import 'no_such_plugin_module'")
    fails({"trainer": {"backend": "jax"}}, "trainer: Value error, backend: unknown backend 'jax'; registered: deepspeed, torch")
    fails({"data": {"type": "mazes"}}, "data.type: unknown source 'mazes'; registered: arithmetic, jsonl, reasoning_gym")


def test_engine_options_without_a_type_are_the_default_engines():
    r = parse_recipe({"name": "t", "rollout": {"engine": {"dtype": "bfloat16"}}})  # as --set rollout.engine.dtype=… makes it
    assert (r.rollout.engine.type, r.rollout.engine.dtype) == ("hf", "bfloat16")


def test_bare_names_defaults_and_a_dumped_recipe_loads_back(tmp_path):
    r = parse_recipe({"name": "t", "workflow": "multi_turn_tools", "rollout": {"engine": "scripted"}, "trainer": {"loss": "m2po"}})
    assert (r.workflow, r.workflow_options.max_turns, r.rollout.engine.latency, r.trainer.loss.tau) == (
        "multi_turn_tools",
        4,
        "lognormal",
        0.01,
    )
    default = parse_recipe({"name": "t"})
    assert (default.workflow, default.rollout.engine.type, default.trainer.loss.type) == ("single_turn", "hf", "ppo")
    dump_recipe(r, tmp_path / "recipe.yaml")
    dumped = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    assert dumped["workflow"]["tools"] == ["calculator", "search"] and dumped["rollout"]["engine"]["latency_alpha"] == 1.5
    assert load_recipe(tmp_path / "recipe.yaml") == r


def test_overrides_open_a_bare_name_and_a_policy_may_pick_another_loss(tmp_path):
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({
        "name": "t", "rollout": {"engine": "scripted"}, "trainer": {"loss": {"type": "m2po", "tau": 0.004}},
        "policies": {"solver": {}, "verifier": {"trainer": {"loss": {"type": "ppo", "clip_high": 0.3}}}}}))
    r = load_recipe(tmp_path, ["rollout.engine.latency_median_s=0.1", "policies.solver.trainer.loss.tau=0.02"])
    assert r.rollout.engine.type == "scripted" and r.rollout.engine.latency_median_s == 0.1
    assert r.policies["solver"].trainer.loss.model_dump() == {"type": "m2po", "tau": 0.02}
    assert r.policies["verifier"].trainer.loss.model_dump() == {"type": "ppo", "clip_low": 0.2, "clip_high": 0.3, "dual_clip": 3.0}


def test_an_override_of_a_default_reaches_the_policies_of_a_stored_recipe_that_inherit_it(tmp_path):
    """A run directory keeps the resolved recipe (every policy's trainer written out): ``--resume --set trainer.steps=80``
    must still lengthen the run. A policy with a value of its own keeps it."""
    (tmp_path / "src.yaml").write_text(yaml.safe_dump({
        "name": "t", "trainer": {"steps": 40, "lr": 2e-4}, "sft": {"steps": 8},
        "policies": {"solver": {}, "verifier": {"trainer": {"steps": 10}}}}))
    dump_recipe(load_recipe(tmp_path / "src.yaml"), tmp_path / "recipe.yaml")
    stored = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    assert stored["policies"]["solver"]["trainer"]["steps"] == 40  # spelled out: what made the override miss
    r = load_recipe(tmp_path / "recipe.yaml", ["trainer.steps=80", "sft.steps=0", "trainer.lr=1e-4"])
    assert (r.trainer.steps, r.policies["solver"].trainer.steps, r.policies["verifier"].trainer.steps) == (80, 80, 10)
    assert r.policies["solver"].sft.steps == r.policies["verifier"].sft.steps == 0
    assert r.policies["solver"].trainer.lr == r.policies["verifier"].trainer.lr == 1e-4
    assert load_recipe(tmp_path / "src.yaml", ["trainer.steps=80"]).policies["verifier"].trainer.steps == 10


def test_a_plugin_engine_and_loss_are_selected_from_yaml(tmp_path):
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({
        "name": "plugins", "model": MODEL, "data": {"n_train": 8, "n_eval": 2},
        "rollout": {"plugins": [str(PLUGIN)], "engine": {"type": "echo", "repeat": 3}},
        "trainer": {"plugins": [str(PLUGIN)], "loss": {"type": "reinforce", "scale": 0.5}, "lr": 1e-2, "backend": "torch_twin"}}))
    recipe = load_recipe(tmp_path)
    assert "echo" in ENGINES.names()
    assert recipe.rollout.engine.model_dump() == {"type": "echo", "repeat": 3, "logprob": -0.5}
    assert recipe.trainer.loss.model_dump() == {"type": "reinforce", "scale": 0.5}

    tok = load_tokenizer("byt5")
    engine = build_engine(recipe.policies["solver"].model, recipe.rollout, tok)
    (c,) = engine.generate([GenerationRequest([5, 6, 7, 8])])
    assert (c.token_ids, c.logprobs) == ([6, 7, 8], [-0.5] * 3)
    half = type("HalfEngine", (), {"version": -1, "generate": engine.generate, "load_state": engine.load_state,
                                   "state_view": engine.state_view})()
    with pytest.raises(TypeError, match=r"engine 'echo' built a HalfEngine that lacks \['expect_callers', 'close'\]"):
        checked_engine(half, "echo")  # a plug-in that leaves part of the contract out fails when it is built, not mid-run

    model = build_model(recipe.policies["solver"].model, tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train, _ = load_split(recipe.data)
    (batch,) = sample_batches(model, tok, [p.prompt for p in train], groups_per_batch=2, group_size=2, seed=1)
    backend = BACKENDS.get(recipe.policies["solver"].trainer.backend)(model, tok, recipe.policies["solver"].trainer)
    assert isinstance(backend, TorchBackend) and backend.registered_as == "torch_twin"  # the plug-in's, by its name
    metrics = backend.step(batch)
    assert metrics["reinforce_scale"] == 0.5 and metrics["loss"] == metrics["pg_loss"]
    assert max(float((v - before[k]).abs().max()) for k, v in model.state_dict().items()) > 0  # the plug-in loss trained

    with pytest.raises(RecipeError, match=r"rollout.engine.repeat: Input should be greater than or equal to 1"):
        load_recipe(tmp_path, ["rollout.engine.repeat=0"])
    with pytest.raises(RecipeError, match=r"trainer.loss.tau: not an option of loss reinforce \(it is an option of m2po\)"):
        load_recipe(tmp_path, ["trainer.loss.tau=0.1"])


def test_workflows_declare_their_roles_and_evaluation():
    assert evaluation_of("single_turn") == evaluation_of("multi_turn_tools") == evaluation_of("env_http") == "workflow"
    assert evaluation_of("solver_verifier") == evaluation_of("solver_testgen") == "team"  # every policy and the team, each recorded
    assert evaluation_of("openai_agent") == evaluation_of("solver_selector") == "single_turn"
    agent_options = WORKFLOWS.parse({"type": "openai_agent", "agent": "my_agents:solve"})
    assert evaluation_of("openai_agent", agent_options) == "workflow"  # agent code in the node is played on held-out prompts
    assert evaluation_of("openai_agent", WORKFLOWS.parse({"type": "openai_agent", "agent": "external"})) == "single_turn"
    check_policies("solver_verifier", ("codegen", "verifier"))
    with pytest.raises(ValueError, match=r"workflow 'solver_verifier' calls 2 policies \(solver, verifier\); the recipe has 1: solver"):
        check_policies("solver_verifier", ("solver",))
    with pytest.raises(ValueError, match=r"workflow 'single_turn' calls 1 policy \(solver\); the recipe has 2"):
        check_policies("single_turn", ("solver", "verifier"))


def test_a_recipe_whose_generations_leave_no_room_for_a_prompt_fails_at_load():
    with pytest.raises(ValueError, match="rollout.max_new_tokens"):  # every task would be turned away by every node
        parse_recipe({"name": "r", "model": {"max_positions": 64}, "rollout": {"max_new_tokens": 64}})


def test_arithmetic_operands_span_min_to_max_operand_and_a_reversed_range_fails_at_load():
    recipe = parse_recipe({"name": "t", "data": {"min_operand": 10, "max_operand": 99, "n_train": 7900, "n_eval": 200}})
    train, held_out = load_split(recipe.data)
    operands = {int(x) for p in train + held_out for x in p.prompt.rstrip("=").split("+")}
    assert (len(train), len(held_out), min(operands), max(operands)) == (7900, 200, 10, 99)
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in held_out}
    fails({"data": {"min_operand": 20, "max_operand": 19}}, "data: Value error, data.min_operand (20) must not exceed")


@pytest.mark.parametrize("args, said", [
    (["rollout", "--policy", "solver"], "--policy is an option of the trainer role, not of rollout"),
    (["dataflow", "--pool", "gpu"], "--pool is an option of the rollout role, not of dataflow"),
    (["trainer", "--metrics-port", "70000"], "--metrics-port: Input should be less than or equal to 65535"),
    (["rollout", "--id", "a.b"], "worker id 'a.b' must match"),
    (["learner"], "unknown role 'learner': dataflow | rollout | trainer | evaluator"),
    (["rollout", "--cores", "0,x"], "--cores: '0,x' is not a list of CPU numbers"),
    (["evaluator", "--cores", "-1"], "--cores: Value error, give one CPU number or more, none negative"),
    (["trainer", "--cores", "1"], "--cores: Value error, a trainer runs on trainer.cores"),
])
def test_a_worker_takes_its_own_roles_options_and_names_the_one_it_refuses(args: list[str], said: str):
    """``astraflow worker ROLE``: the flags build that role's option model (``astraflow.role``); another role's flag,
    a bad value or an unknown role fails at once, before any connection, with the flag named."""
    from typer.testing import CliRunner

    from astraflow.cli import app

    recipe = Path(__file__).resolve().parent.parent / "recipes" / "arithmetic"
    out = CliRunner().invoke(app, ["worker", *args, "--recipe", str(recipe), "--nats", "nats://127.0.0.1:1", "--run", "r"])
    assert out.exit_code == 2 and said in out.output, out.output
