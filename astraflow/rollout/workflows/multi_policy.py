"""Multi-policy workflows: one task, trajectories for two policies, each routed to its own trainer.

The task names the solver (``task.policy``); the partner is the recipe's other policy
(``policies: {solver: {}, verifier: {}}`` — the first solves, the second is the partner).
Every trajectory is tagged with the policy whose tokens it holds, so the worker publishes it
on ``traj.{policy}`` and the dataflow groups it per ``(task_id, policy)``; ``group_size`` is
the number of trajectories of that policy for that task.

- ``solver_verifier``: the solver answers ``group_size`` times (reward: the recipe's verifier);
  the verifier judges each answer ("yes"/"no") and is rewarded 1 when its verdict matches the
  real verifier's, else 0 (an unreadable verdict is wrong). Evaluated as a team (``evaluate``):
  the solver, the verifier's accuracy, and the answer the verifier picks out of k samples.
- ``solver_selector``: the solver answers ``group_size`` times; the selector sees all answers,
  names one by number, ``group_size`` times, and is rewarded with the chosen answer's reward.
- ``solver_testgen``: code tasks (``meta["tests"]``, ``meta["reference"]``). The solver writes
  code (reward: pass fraction of the hidden tests, sandboxed); the test-case generator writes
  ``assert`` lines. Its reward is 0 unless every generated test passes the reference solution;
  otherwise the fraction of solver candidates the tests judge right (they pass the generated
  tests exactly when they pass all hidden tests). Evaluated as a team (``evaluate``): the
  solver, the test-case generator's reward, and the first of k samples its tests pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import lru_cache
from typing import Any

from astraflow.registry import WORKFLOWS
from astraflow.rollout.engines.base import Completion, GenerationRequest
from astraflow.rollout.rewards import Reward, extract_code
from astraflow.rollout.rewards.sandbox import Sandbox
from astraflow.rollout.scores import sample_metrics
from astraflow.rollout.workflows.base import TEAM, Evaluation, PolicyHandle, by_policy, make_trajectory, min_version
from astraflow.rollout.workflows.options import SolverSelectorOptions, SolverTestgenOptions, SolverVerifierOptions
from astraflow.streams.messages import Task, Trajectory
from astraflow.tasks import Problem

Run = Callable[[str, tuple[str, ...]], tuple[bool, ...]]
"""``run(program, tests) -> which tests it passes`` (in the sandbox)."""


def partner_of(policies: Mapping[str, PolicyHandle], solver: str, role: str) -> str:
    others = [p for p in policies if p != solver]
    if not others:
        raise ValueError(f"a {role} workflow needs two policies (the solver {solver!r} and a {role}); the recipe has one")
    return others[0]


def parse_verdict(text: str) -> bool | None:
    m = re.search(r"\b(yes|no|correct|incorrect|true|false|right|wrong)\b", text.lower())
    if m is None:
        first = text.strip()[:1].lower()
        return {"y": True, "n": False}.get(first)
    return m.group(1) in ("yes", "correct", "true", "right")


def parse_choice(text: str, n: int) -> int | None:
    m = re.search(r"\d+", text)
    if m is None:
        return None
    k = int(m.group()) - 1  # candidates are numbered from 1
    return k if 0 <= k < n else None


class _TwoPolicy:
    policies: tuple[str, ...]  # ("solver", partner role)
    evaluation: Evaluation = "single_turn"  # the partner's answers need the solver's: score the solver alone

    def __init__(self, reward: Reward, options: Any = None) -> None:
        self.reward = reward

    def solve(self, tasks: list[Task], h: PolicyHandle, policy: str, node_id: str) -> tuple[list[list[Completion]], list[list[str]]]:
        prompts = [h.encode(t.prompt) for t in tasks]
        reqs = [GenerationRequest(p, h.params) for p, t in zip(prompts, tasks) for _ in range(t.group_size)]
        comps = iter(h.generate(reqs, max(min_version(t, policy) for t in tasks)))
        per_task = [[next(comps) for _ in range(t.group_size)] for t in tasks]
        return per_task, [[h.decode(c.token_ids) for c in cs] for cs in per_task]

    def sample(self, problems: list[Problem], hs: PolicyHandle, solver: str, k: int,
               temperature: float) -> tuple[list[Task], list[str], list[list[str]]]:
        """Held-out prompts as tasks of ``k`` samples, the solver's greedy answer to each, and its ``k`` sampled answers."""
        tasks = [Task(task_id=f"eval-{i}", workflow="eval", policy=solver, prompt_id=p.prompt_id, prompt=p.prompt,
                      group_size=k, meta=p.meta) for i, p in enumerate(problems)]
        greedy = replace(hs, params=replace(hs.params, temperature=0.0))
        _, firsts = self.solve([t.model_copy(update={"group_size": 1}) for t in tasks], greedy, solver, "evaluator")
        _, texts = self.solve(tasks, replace(hs, params=replace(hs.params, temperature=temperature)), solver, "evaluator")
        return tasks, [xs[0] for xs in firsts], texts

    def run(self, tasks: list[Task], policies: Mapping[str, PolicyHandle], node_id: str) -> list[Trajectory]:
        out: list[Trajectory] = []
        for solver, group in by_policy(tasks).items():
            partner = partner_of(policies, solver, self.policies[1])
            out += self.run_pair(group, policies[solver], solver, policies[partner], partner, node_id)
        return out

    def run_pair(self, tasks: list[Task], hs: PolicyHandle, solver: str, hp: PolicyHandle, partner: str, node_id: str) -> list[Trajectory]:
        raise NotImplementedError

    def solver_trajectories(self, tasks: list[Task], hs: PolicyHandle, solver: str, comps: list[list[Completion]],
                            rewards: list[list[float]], node_id: str) -> list[Trajectory]:
        return [make_trajectory(t, solver, i, t.group_size, hs.encode(t.prompt), c.token_ids, c.logprobs, c.versions, None,
                                rewards[k][i], c.finish_reason, node_id, {"role": "solver"}, c.routing)
                for k, t in enumerate(tasks) for i, c in enumerate(comps[k])]


@WORKFLOWS.register("solver_verifier", SolverVerifierOptions)
class SolverVerifier(_TwoPolicy):
    policies = ("solver", "verifier")
    evaluation: Evaluation = "team"  # the verifier's accuracy and the team's pick need both policies

    @staticmethod
    def prompt(task: Task, answer: str) -> str:
        return f"{task.prompt}{answer.strip()}\nCorrect? "

    def judge(
        self, tasks: list[Task], texts: list[list[str]], hv: PolicyHandle, verifier: str
    ) -> tuple[list[list[list[int]]], list[Completion]]:
        """The verifier's prompt for every answer (per task) and its completions, in order."""
        vprompts = [[hv.encode(self.prompt(t, x)) for x in xs] for t, xs in zip(tasks, texts)]
        vreqs = [GenerationRequest(p, hv.params) for ps in vprompts for p in ps]
        return vprompts, hv.generate(vreqs, max(min_version(t, verifier) for t in tasks))

    def run_pair(self, tasks: list[Task], hs: PolicyHandle, solver: str, hv: PolicyHandle, verifier: str, node_id: str) -> list[Trajectory]:
        comps, texts = self.solve(tasks, hs, solver, node_id)
        rewards = [[self.reward(x, t.meta) for x in xs] for t, xs in zip(tasks, texts)]
        out = self.solver_trajectories(tasks, hs, solver, comps, rewards, node_id)
        vprompts, judged = self.judge(tasks, texts, hv, verifier)
        vcomps = iter(judged)
        for k, t in enumerate(tasks):
            for i in range(t.group_size):
                c = next(vcomps)
                verdict = parse_verdict(hv.decode(c.token_ids))
                truth = rewards[k][i] >= 0.5
                out.append(make_trajectory(t, verifier, i, t.group_size, vprompts[k][i], c.token_ids, c.logprobs, c.versions, None,
                                           1.0 if verdict is not None and verdict == truth else 0.0, c.finish_reason, node_id,
                                           {"role": "verifier", "judged": f"{t.task_id}.{solver}.{i}", "verdict": verdict, "truth": truth},
                                           c.routing))
        return out

    def evaluate(self, problems: list[Problem], policies: Mapping[str, PolicyHandle], k: int,
                 temperature: float) -> dict[str, dict[str, float]]:
        """The solver answers each held-out prompt greedily and ``k`` times at ``temperature``; the verifier judges
        every sample greedily. Subjects: the solver (greedy ``reward``, ``avg@k``, ``pass@k``); the verifier
        (``reward``: the accuracy of its verdicts, its RL reward, over all k·n samples); the team: the first
        sample the verifier accepts, or the first sample when it accepts none (``reward``), beside the solver
        alone at the same k samples (``avg@k``) and the best any pick could do (``pass@k``)."""
        (solver, hs), (verifier, hv) = list(policies.items())[:2]
        tasks, firsts, texts = self.sample(problems, hs, solver, k, temperature)
        rewards = [[self.reward(x, t.meta) for x in xs] for t, xs in zip(tasks, texts)]
        judge = replace(hv, params=replace(hv.params, temperature=0.0))
        judged = iter(self.judge(tasks, texts, judge, verifier)[1])
        verdicts = [[parse_verdict(judge.decode(next(judged).token_ids)) for _ in xs] for xs in texts]
        right = [v is not None and v == (r >= 0.5) for vs, rs in zip(verdicts, rewards) for v, r in zip(vs, rs)]
        picked = [rs[next((j for j, v in enumerate(vs) if v), 0)] for vs, rs in zip(verdicts, rewards)]
        greedy = [self.reward(x, t.meta) for t, x in zip(tasks, firsts)]
        return team_scores(solver, greedy, rewards, verifier, sum(right) / max(1, len(right)), picked, k)


@WORKFLOWS.register("solver_selector", SolverSelectorOptions)
class SolverSelector(_TwoPolicy):
    policies = ("solver", "selector")

    @staticmethod
    def prompt(task: Task, answers: list[str]) -> str:
        listed = "\n".join(f"{n + 1}: {a.strip()}" for n, a in enumerate(answers))
        return f"{task.prompt}\n{listed}\nBest: "

    def run_pair(
        self, tasks: list[Task], hs: PolicyHandle, solver: str, hsel: PolicyHandle, selector: str, node_id: str
    ) -> list[Trajectory]:
        comps, texts = self.solve(tasks, hs, solver, node_id)
        rewards = [[self.reward(x, t.meta) for x in xs] for t, xs in zip(tasks, texts)]
        out = self.solver_trajectories(tasks, hs, solver, comps, rewards, node_id)
        sprompts = [hsel.encode(self.prompt(t, xs)) for t, xs in zip(tasks, texts)]
        sreqs = [GenerationRequest(p, hsel.params) for p, t in zip(sprompts, tasks) for _ in range(t.group_size)]
        scomps = iter(hsel.generate(sreqs, max(min_version(t, selector) for t in tasks)))
        for k, t in enumerate(tasks):
            for i in range(t.group_size):
                c = next(scomps)
                choice = parse_choice(hsel.decode(c.token_ids), len(texts[k]))
                out.append(make_trajectory(t, selector, i, t.group_size, sprompts[k], c.token_ids, c.logprobs, c.versions, None,
                                           rewards[k][choice] if choice is not None else 0.0, c.finish_reason, node_id,
                                           {"role": "selector", "choice": choice}, c.routing))
        return out


@WORKFLOWS.register("solver_testgen", SolverTestgenOptions)
class SolverTestgen(_TwoPolicy):
    policies = ("solver", "testgen")
    evaluation: Evaluation = "team"  # the generated tests are scored on the solver's samples

    @staticmethod
    def prompt(task: Task) -> str:
        return f"{task.prompt}\nWrite assert statements that test a correct solution:\n"

    @staticmethod
    def parse_tests(text: str) -> list[str]:
        return [line.strip() for line in extract_code(text).splitlines() if line.strip().startswith("assert ")]

    @staticmethod
    def judge_tests(
        run: Run, task: Task, tests: list[str], texts: list[str], hidden: list[tuple[bool, ...]]
    ) -> tuple[bool, float, list[bool]]:
        """(valid, reward, which answers pass) of one generated test set: invalid unless every test passes the
        reference (reward 0); else the reward is the fraction of answers the tests judge as the hidden tests do."""
        if not (tests and all(run(task.meta["reference"], tuple(tests)))):
            return False, 0.0, [False] * len(texts)
        passes = [all(run(extract_code(x), tuple(tests))) for x in texts]
        return True, sum(p == all(h) for p, h in zip(passes, hidden)) / max(1, len(texts)), passes

    @staticmethod
    def hidden(run: Run, tasks: list[Task], texts: list[list[str]]) -> list[list[tuple[bool, ...]]]:
        return [[run(extract_code(x), tuple(t.meta["tests"])) for x in xs] for t, xs in zip(tasks, texts)]

    @staticmethod
    def sandbox() -> Run:
        """Which tests a program passes, each (program, tests) pair run once in the sandbox (samples often repeat)."""
        box = Sandbox()
        return lru_cache(maxsize=None)(lambda code, tests: tuple(box.run(code, list(tests)).passed))

    def run_pair(self, tasks: list[Task], hs: PolicyHandle, solver: str, hg: PolicyHandle, gen: str, node_id: str) -> list[Trajectory]:
        comps, texts = self.solve(tasks, hs, solver, node_id)
        run = self.sandbox()
        hidden_pass = self.hidden(run, tasks, texts)
        rewards = [[sum(p) / len(p) if p else 0.0 for p in ps] for ps in hidden_pass]
        out = self.solver_trajectories(tasks, hs, solver, comps, rewards, node_id)
        gprompts = [hg.encode(self.prompt(t)) for t in tasks]
        greqs = [GenerationRequest(p, hg.params) for p, t in zip(gprompts, tasks) for _ in range(t.group_size)]
        gcomps = iter(hg.generate(greqs, max(min_version(t, gen) for t in tasks)))
        for k, t in enumerate(tasks):
            for i in range(t.group_size):
                c = next(gcomps)
                tests = self.parse_tests(hg.decode(c.token_ids))
                valid, reward, _ = self.judge_tests(run, t, tests, texts[k], hidden_pass[k])
                out.append(make_trajectory(t, gen, i, t.group_size, gprompts[k], c.token_ids, c.logprobs, c.versions, None, reward,
                                           c.finish_reason, node_id, {"role": "testgen", "tests": len(tests), "valid": valid},
                                           c.routing))
        return out

    def evaluate(self, problems: list[Problem], policies: Mapping[str, PolicyHandle], k: int,
                 temperature: float) -> dict[str, dict[str, float]]:
        """The solver answers each held-out prompt greedily and ``k`` times at ``temperature``; the test-case
        generator writes one test set greedily. Subjects: the solver (greedy ``reward``, ``avg@k``, ``pass@k``); the
        test-case generator (``reward``: its RL reward on the k samples); the team: the first sample that passes the
        generated tests, or the first sample when none does or the tests are invalid (``reward``), beside the
        solver alone at the same k samples (``avg@k``) and the best any pick could do (``pass@k``)."""
        (solver, hs), (gen, hg) = list(policies.items())[:2]
        tasks, firsts, texts = self.sample(problems, hs, solver, k, temperature)
        run = self.sandbox()
        hidden_pass = self.hidden(run, tasks, texts)
        rewards = [[sum(p) / len(p) if p else 0.0 for p in ps] for ps in hidden_pass]
        params = replace(hg.params, temperature=0.0)
        written = hg.generate([GenerationRequest(hg.encode(self.prompt(t)), params) for t in tasks])
        gen_rewards, picked = [], []
        for t, c, xs, hp, rs in zip(tasks, written, texts, hidden_pass, rewards):
            _, reward, passes = self.judge_tests(run, t, self.parse_tests(hg.decode(c.token_ids)), xs, hp)
            gen_rewards.append(reward)
            picked.append(rs[next((j for j, p in enumerate(passes) if p), 0)])
        greedy = [self.reward(x, t.meta) for t, x in zip(tasks, firsts)]
        return team_scores(solver, greedy, rewards, gen, sum(gen_rewards) / max(1, len(gen_rewards)), picked, k)


def team_scores(solver: str, greedy: list[float], rewards: list[list[float]], partner: str, partner_reward: float,
                picked: list[float], k: int) -> dict[str, dict[str, float]]:
    """A team evaluation's records: the solver's greedy reward and its k samples, the partner's own reward, and
    the team's pick beside the solver alone at the same k samples."""
    alone, n = sample_metrics(rewards, k), float(len(rewards))
    return {solver: {"reward": sum(greedy) / max(1, len(greedy)), **alone, "k": float(k), "n": n},
            partner: {"reward": partner_reward, "avg@k": partner_reward, "pass@k": partner_reward, "k": float(k), "n": n},
            TEAM: {"reward": sum(picked) / max(1, len(picked)), **alone, "k": float(k), "n": n}}
