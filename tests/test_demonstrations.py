"""Multi-turn demonstrations: recorded through a recipe's own workflow, replayed by the SFT warm start with
what the workflow inserted masked out, never from held-out problems."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from astraflow.config import SFTConfig, load_recipe, parse_recipe
from astraflow.demonstrations import Demonstration, demonstration_tokens, read_demonstrations, write_demonstrations
from astraflow.models import build_model, encode_prompt, load_tokenizer
from astraflow.rollout.experts import record
from astraflow.streams.messages import Task
from astraflow.tasks import Problem
from astraflow.train.sft import demonstration_examples, sft

TOK = load_tokenizer("byt5")
ROOT = Path(__file__).resolve().parent.parent


def calculator_recipe(**over):
    return parse_recipe({"name": "calc", "workflow": {"type": "multi_turn_tools", "max_turns": 2, "tools": ["calculator"]},
                         "rollout": {"max_new_tokens": 40}, **over})


def problems(n: int = 3) -> list[Problem]:
    return [Problem(f"p{i}", f"Compute {i + 11}*{i + 7}.\n", {"answer": str((i + 11) * (i + 7))}) for i in range(n)]


def calculating(rng: random.Random):
    def expert(task: Task, context: str) -> str:
        found = re.search(r"<result>(\d+)</result>$", context)
        return found.group(1) if found else "<tool>calculator({}*{})</tool>".format(*re.findall(r"\d+", task.prompt))

    return expert


def test_record_plays_the_workflow_and_keeps_its_masks():
    demos = record(calculator_recipe(), {"solver": calculating}, problems(2), per_problem=2)["solver"]
    assert len(demos) == 4 and {d.prompt_id for d in demos} == {"p0", "p1"}
    d = demos[0]
    assert d.prompt == "Compute 11*7.\n" and d.eos and d.reward == 1.0
    assert d.segments == [("<tool>calculator(11*7)</tool>", True), ("<result>77</result>", False), ("77", True)]
    ids, trained = demonstration_tokens(d, TOK)
    text = "Compute 11*7.\n<tool>calculator(11*7)</tool><result>77</result>77"
    assert ids == encode_prompt(TOK, text) + [TOK.eos_token_id]
    masked = TOK.decode([i for i, t in zip(ids, trained) if not t])
    assert masked == "Compute 11*7.\n<result>77</result>"  # the prompt and the tool output carry no loss


def test_record_refuses_a_turn_longer_than_the_rollout_allows():
    with pytest.raises(ValueError, match="max_new_tokens"):
        record(calculator_recipe(rollout={"max_new_tokens": 8}), {"solver": calculating}, problems(1))


def test_record_plays_an_environment_episode(tmp_path):
    recipe = parse_recipe({"name": "t", "workflow": {"type": "env_http", "url": "bundled", "env": "terminal", "max_turns": 3},
                           "rollout": {"max_new_tokens": 32}})

    def looker(rng: random.Random):
        def expert(task: Task, context: str) -> str:
            keyword = re.search(r"contains (\w+)", context).group(1)
            return f"grep -l {keyword} *.txt\n" if context.count("\n> ") == 1 else "exit\n"
        return expert

    (d,) = record(recipe, {"solver": looker}, [Problem("e", "", {"seed": 3})])["solver"]
    assert d.prompt.startswith("Task: ") and d.prompt.endswith("\n> ") and not d.eos
    (grep, grep_trained), (found, found_trained), (leave, leave_trained) = d.segments  # the episode ends at exit: no output after
    assert (grep_trained, found_trained, leave, leave_trained) == (True, False, "exit\n", True)
    assert grep.startswith("grep -l ") and found.endswith(".txt\n> ")  # the sandboxed command's real output
    path = tmp_path / "demos.jsonl"
    assert write_demonstrations(path, [d]) == 1 and read_demonstrations(path) == [d]


def test_sft_trains_only_on_what_the_model_wrote_and_only_on_training_problems(tmp_path):
    path = tmp_path / "demos.jsonl"
    write_demonstrations(path, [
        Demonstration(prompt_id="train", prompt="Q\n", segments=[("<tool>a</tool>", True), ("<result>b</result>", False), ("c", True)]),
        Demonstration(prompt_id="held", prompt="Q\n", segments=[("leak", True)])])
    examples = demonstration_examples(TOK, [Problem("train", "Q\n")], str(path), 64)
    assert len(examples) == 1  # the held-out problem's episode is never used
    ids, trained = examples[0]
    assert TOK.decode([i for i, t in zip(ids, trained) if t]) == "<tool>a</tool>c</s>"
    with pytest.raises(ValueError, match="no episode plays a training problem"):
        demonstration_examples(TOK, [Problem("other", "Q\n")], str(path), 64)
    with pytest.raises(ValueError, match="model.max_positions"):
        demonstration_examples(TOK, [Problem("train", "Q\n")], str(path), 8)


def test_sft_on_demonstrations_learns_the_turns(tmp_path):
    path = tmp_path / "demos.jsonl"
    write_demonstrations(path, [Demonstration(prompt_id="p", prompt="go\n", segments=[("ab", True), ("zz", False), ("cd", True)])])
    recipe = parse_recipe({"name": "s", "model": {"hidden_size": 32, "intermediate_size": 64}})
    model = build_model(recipe.policies["solver"].model, TOK)
    loss = sft(model, TOK, [Problem("p", "go\n")], SFTConfig(steps=60, lr=0.01, batch_size=4, demonstrations=str(path)))
    assert loss < 0.1
    ids = torch.tensor([encode_prompt(TOK, "go\nabzz")])
    assert TOK.decode(model(input_ids=ids).logits[0, -1].argmax().item()) == "c"


def test_a_bad_demonstration_line_names_its_number(tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_text('{"prompt_id": "p", "prompt": "", "segments": []}\n{"prompt_id": "p"}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_demonstrations(path)


def test_demonstration_files_resolve_against_the_recipe_folder():
    recipe = load_recipe(ROOT / "recipes" / "code-multi-agent")
    assert recipe.policies["solver"].sft.demonstrations == str(ROOT / "recipes" / "code" / "demos.jsonl")
    assert recipe.policies["testgen"].sft.demonstrations == str(ROOT / "recipes" / "code-multi-agent" / "testgen_demos.jsonl")
    assert load_recipe(ROOT / "recipes" / "search").sft.demonstrations == str(ROOT / "recipes" / "search" / "demos.jsonl")


@pytest.mark.parametrize("name", ["search", "calculator", "code", "alfworld", "webshop", "terminal", "code-multi-agent",
                                  "math-multi-agent"])
def test_shipped_demonstrations_cover_training_problems_only(name: str):
    from astraflow.tasks import load_split

    recipe = load_recipe(ROOT / "recipes" / name)
    train, held_out = load_split(recipe.data)
    demonstrated = [p for p in recipe.policies.values() if p.sft.demonstrations]
    assert demonstrated
    for policy in demonstrated:
        demos = read_demonstrations(policy.sft.demonstrations)
        assert {d.prompt_id for d in demos} <= {p.prompt_id for p in train}
        assert not {d.prompt_id for d in demos} & {p.prompt_id for p in held_out}
        assert demonstration_examples(TOK, train, policy.sft.demonstrations, policy.model.max_positions)
