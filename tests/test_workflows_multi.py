"""Multi-policy workflows: each trajectory tagged with its policy, groups sized per (task, policy).

The last test runs a solver + verifier recipe end to end with ``astraflow up`` (one trainer
per policy, every role its own process) on a real nats-server.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from astraflow.config import load_recipe
from astraflow.models import load_tokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.testing import ScriptEngine
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.multi_policy import parse_choice, parse_verdict
from astraflow.rollout.workflows.registry import evaluation_of, get_workflow
from astraflow.streams.messages import Task
from astraflow.tasks import Problem

TOK = load_tokenizer("byt5")


def handle(reply, name: str) -> PolicyHandle:
    return PolicyHandle(ScriptEngine(TOK, reply), TOK, SamplingParams(max_new_tokens=200), name=name)


def alternating(*texts: str):
    """A reply function cycling through ``texts`` call after call."""
    state = {"n": 0}

    def reply(prompt: str) -> str:
        state["n"] += 1
        return texts[(state["n"] - 1) % len(texts)]

    return reply


def check_groups(trajs, tasks, policies):
    counts = Counter((t.task_id, t.policy) for t in trajs)
    for t in trajs:
        assert t.group_size == counts[(t.task_id, t.policy)]  # the dataflow groups per (task, policy)
        assert t.traj_id == f"{t.task_id}.{t.policy}.{t.index}"
    assert set(counts) == {(t.task_id, p) for t in tasks for p in policies}


def test_verdict_and_choice_parsing():
    assert parse_verdict(" yes, it is") is True and parse_verdict("Incorrect.") is False
    assert parse_verdict("n") is False and parse_verdict("???") is None
    assert parse_choice("Best: 2", 3) == 1 and parse_choice("7", 3) is None and parse_choice("none", 3) is None


def test_solver_verifier_rewards_correct_verdicts():
    tasks = [Task(task_id=f"t{i}", workflow="solver_verifier", policy="solver", prompt_id=f"p{i}", prompt=f"{i}+1=",
                  group_size=4, meta={"answer": str(i + 1)}) for i in range(2)]
    solver = handle(lambda p: p.split("+")[0] if "+" in p else "0", "solver")  # wrong: answers i instead of i+1
    solver.engine.reply = alternating("1", "2")  # t0: right, wrong, right, wrong; t1: wrong, right, wrong, right
    verifier = handle(lambda p: "yes", "verifier")  # always says "correct"
    wf = get_workflow("solver_verifier", get_reward("arithmetic"))
    trajs = wf.run(tasks, {"solver": solver, "verifier": verifier}, "n0")
    check_groups(trajs, tasks, ("solver", "verifier"))
    by_id = {t.traj_id: t for t in trajs}
    for t in trajs:
        if t.policy == "verifier":
            judged = by_id[t.meta["judged"]]
            assert t.reward == (1.0 if judged.reward == 1.0 else 0.0)  # "yes" is right exactly when the answer is
            assert TOK.decode(t.prompt_tokens().tolist()).endswith("Correct? ")
    assert sorted(t.reward for t in trajs if t.policy == "solver") == [0.0] * 4 + [1.0] * 4


def test_shipped_verifier_demonstrations_judge_better_than_chance_but_not_perfectly(repo_root):
    from astraflow.demonstrations import read_demonstrations

    recipe = load_recipe(repo_root / "recipes" / "math-multi-agent")
    demos = read_demonstrations(recipe.policies["verifier"].sft.demonstrations)
    right = []
    for d in demos:
        a, b, answer = map(int, re.fullmatch(r"(\d+)\+(\d+)=(\d+)\nCorrect\? ", d.prompt).groups())  # the workflow's prompt
        (reply, written), = d.segments
        verdict = parse_verdict(reply)
        assert written and d.eos and verdict is not None, reply
        right.append(verdict == (a + b == answer))
    assert 0.8 < sum(right) / len(right) < 0.95  # the judge is noisy: RL has room to raise the verifier's accuracy
    assert 0.2 < sum(parse_verdict(d.segments[0][0]) is True for d in demos) / len(demos) < 0.6  # both verdicts are taught


def test_solver_selector_rewards_the_chosen_answer():
    tasks = [Task(task_id="t0", workflow="solver_selector", policy="solver", prompt_id="p", prompt="2+2=", group_size=3,
                  meta={"answer": "4"})]
    solver = handle(alternating("5", "4", "3"), "solver")
    selector = handle(alternating("Best: 2", "1", "nonsense"), "selector")
    trajs = get_workflow("solver_selector", get_reward("arithmetic")).run(tasks, {"solver": solver, "selector": selector}, "n0")
    check_groups(trajs, tasks, ("solver", "selector"))
    sel = sorted((t for t in trajs if t.policy == "selector"), key=lambda t: t.index)
    assert [t.reward for t in sel] == [1.0, 0.0, 0.0] and [t.meta["choice"] for t in sel] == [1, 0, None]


def test_solver_testgen_rewards_valid_discriminating_tests():
    task = Task(task_id="c0", workflow="solver_testgen", policy="solver", prompt_id="double",
                prompt="Write double(x) returning 2*x.", group_size=2,
                meta={"tests": ["assert double(2) == 4", "assert double(-1) == -2"], "reference": "def double(x):\n    return 2 * x\n"})
    solver = handle(alternating("```python\ndef double(x):\n    return x + x\n```", "def double(x):\n    return x * x\n"), "solver")
    gen = handle(alternating("assert double(3) == 6\nassert double(0) == 0", "assert double(2) == 4",
                             "assert double(1) == 3"), "testgen")
    task2 = task.model_copy(update={"task_id": "c1", "group_size": 3})
    trajs = get_workflow("solver_testgen", get_reward("code")).run([task, task2], {"solver": solver, "testgen": gen}, "n0")
    check_groups(trajs, [task, task2], ("solver", "testgen"))
    solver_rewards = {t.traj_id: t.reward for t in trajs if t.policy == "solver"}
    assert solver_rewards["c0.solver.0"] == 1.0 and solver_rewards["c0.solver.1"] == 0.5  # x*x passes double(2) only
    tg = {t.traj_id: (t.reward, t.meta["valid"]) for t in trajs if t.policy == "testgen"}
    assert tg["c0.testgen.0"] == (1.0, True)  # double(3)==6 tells x+x from x*x
    assert tg["c0.testgen.1"] == (0.5, True)  # double(2)==4 passes both: judges the wrong one right
    assert tg["c1.testgen.0"] == (0.0, False)  # double(1)==3 fails the reference: invalid


def test_solver_verifier_team_evaluation():
    """Held out: the solver's greedy answer, its k samples, the verifier's accuracy, and the sample it picks."""
    problems = [Problem(f"p{i}", f"{i}+1=", {"answer": str(i + 1)}) for i in range(2)]
    solver = handle(alternating("9", "0", "9", "1", "9", "2"), "solver")  # greedy: wrong; then wrong, right per prompt
    verifier = handle(lambda p: "yes" if p.split("=")[1].split("\n")[0] == str(int(p.split("+")[0]) + 1) else "no", "verifier")
    wf = get_workflow("solver_verifier", get_reward("arithmetic"))
    assert evaluation_of("solver_verifier") == "team"
    got = wf.evaluate(problems, {"solver": solver, "verifier": verifier}, 2, 1.0)
    assert got["solver"] == {"reward": 0.0, "avg@k": 0.5, "pass@k": 1.0, "k": 2.0, "n": 2.0}
    assert got["verifier"]["reward"] == 1.0  # every verdict right
    assert got["team"]["reward"] == 1.0 and got["team"]["avg@k"] == 0.5  # the verifier's pick beats one sample at random
    lenient = handle(lambda p: "yes", "verifier")
    solver.engine.reply = alternating("9", "0", "9", "1", "9", "2")
    got = wf.evaluate(problems, {"solver": solver, "verifier": lenient}, 2, 1.0)
    assert got["verifier"]["reward"] == 0.5 and got["team"]["reward"] == 0.0  # accepts the first sample: wrong


def test_solver_testgen_team_evaluation():
    problems = [Problem("double", "Write double(x).", {"tests": ["assert double(2) == 4", "assert double(5) == 10"],
                                                       "reference": "def double(x):\n    return 2 * x\n", "answer": ""})]
    solver = handle(alternating("def double(x):\n    print(2 * x)\n", "def double(x):\n    print(x)\n",
                                "def double(x):\n    return x + x\n"), "solver")
    gen = handle(lambda p: "assert double(3) == 6", "testgen")
    got = get_workflow("solver_testgen", get_reward("code")).evaluate(problems, {"solver": solver, "testgen": gen}, 2, 1.0)
    assert got["solver"]["reward"] == 0.0 and got["solver"]["avg@k"] == 0.5
    assert got["testgen"]["reward"] == 1.0  # valid on the reference, judges both samples as the hidden tests do
    assert got["team"]["reward"] == 1.0  # the first sample its test passes
    solver.engine.reply = alternating("def double(x):\n    print(2 * x)\n", "def double(x):\n    print(x)\n",
                                      "def double(x):\n    return x + x\n")
    weak = handle(lambda p: "assert callable(double)", "testgen")
    got = get_workflow("solver_testgen", get_reward("code")).evaluate(problems, {"solver": solver, "testgen": weak}, 2, 1.0)
    assert got["testgen"]["reward"] == 0.5 and got["team"]["reward"] == 0.0  # a test that passes anything picks the first


def test_multi_policy_workflow_needs_two_policies():
    tasks = [Task(task_id="t", workflow="w", policy="solver", prompt_id="p", prompt="1+1=", group_size=1, meta={"answer": "2"})]
    with pytest.raises(ValueError, match="two policies"):
        get_workflow("solver_verifier", get_reward("arithmetic")).run(tasks, {"solver": handle(lambda p: "2", "solver")}, "n")


def up_math_multi_agent(nats_server, repo_root: Path, run_dir: Path, *sets: str) -> list[dict]:
    """``astraflow up recipes/math-multi-agent`` for 2 steps with short warm starts; the metrics rows."""
    recipe = repo_root / "recipes" / "math-multi-agent"
    load_recipe(recipe)  # loads as a recipe
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(recipe), "--nats", nats_server.url, "--run-dir", str(run_dir),
           "--set", "trainer.steps=2", "--set", "sft.steps=20", "--set", "policies.verifier.sft.steps=20", "--set", "rollout.nodes=1",
           "--set", "eval.enabled=false", "--timeout", "240", *(x for s in sets for x in ("--set", s))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    logs = (
        "".join(f"\n--- {p.name}\n" + p.read_text()[-1500:] for p in sorted((run_dir / "logs").glob("*.log")))
        if (run_dir / "logs").exists()
        else ""
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + logs
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for policy in ("solver", "verifier"):  # one trainer per policy, each trained on its own trajectories
        assert [r["version"] for r in rows if r["policy"] == policy] == [0, 1, 2]
    return rows


@pytest.mark.slow
def test_solver_verifier_recipe_runs_end_to_end_with_up(nats_server, repo_root, tmp_path):
    run_dir = tmp_path / "sv-run"
    up_math_multi_agent(nats_server, repo_root, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["policies"]) == {"solver", "verifier"}
    for role in ("trainer-solver", "trainer-verifier", "dataflow", "rollout-0"):
        assert (run_dir / "logs" / f"{role}.s1.log").exists()


@pytest.mark.slow
def test_policies_sharing_a_base_warm_start_it_once_and_nodes_serve_their_adapters_on_it(nats_server, repo_root, tmp_path):
    """``rollout.shared_base``: ``up`` warm-starts one base on both policies' warm-start data (every weight), every role
    loads it as ``model.pretrained``, each trainer adapts it, and the node serves each policy's adapters on that base:
    the trainers recompute the node's logprobs. ``dataflow.mode=sync`` makes every step train on samples of the version
    it holds, so every gap is the numerics of merging adapters (under 1e-4 here): a node that served the last version's
    adapters, or none, is one step off (0.01-0.06 nats on this run), and one on another base is refused, or far off."""
    pytest.importorskip("peft", reason="peft is not installed (pip install 'astraflow[lora]')")
    run_dir = tmp_path / "shared-run"
    rows = up_math_multi_agent(nats_server, repo_root, run_dir, "rollout.shared_base=true", "trainer.lora.rank=4",
                               "dataflow.mode=sync")
    record = json.loads((run_dir / "base" / "warm_start.json").read_text())
    assert record["steps"] == {"solver": 20, "verifier": 20}
    resolved = load_recipe(run_dir / "recipe.yaml")
    for policy in resolved.policies.values():
        assert policy.model.pretrained == str((run_dir / "base").resolve()) and policy.sft.steps == 0
    trained = [r for r in rows if r["version"] > 0]
    assert len(trained) == 4 and all(r["logprob_gap_max"] < 1e-3 for r in trained), trained  # v1's on adapters: not v0's
    assert all(r["bytes"] < 20_000 for r in trained)  # adapters, not the model
    assert "refus" not in (run_dir / "logs" / "rollout-0.s1.log").read_text()
