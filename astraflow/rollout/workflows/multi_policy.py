"""Multi-policy workflows: one task, trajectories for two policies, each routed to its own trainer.

The task names the solver (``task.policy``); the partner is the recipe's other policy
(``policies: {solver: {}, verifier: {}}`` — the first solves, the second is the partner).
Every trajectory is tagged with the policy whose tokens it holds, so the worker publishes it
on ``traj.{policy}`` and the dataflow groups it per ``(task_id, policy)``; ``group_size`` is
the number of trajectories of that policy for that task.

- ``solver_verifier``: the solver answers ``group_size`` times (reward: the recipe's verifier);
  the verifier judges each answer ("yes"/"no") and is rewarded 1 when its verdict matches the
  real verifier's, else 0 (an unreadable verdict is wrong).
- ``solver_selector``: the solver answers ``group_size`` times; the selector sees all answers,
  names one by number, ``group_size`` times, and is rewarded with the chosen answer's reward.
- ``solver_testgen``: code tasks (``meta["tests"]``, ``meta["reference"]``). The solver writes
  code (reward: pass fraction of the hidden tests, sandboxed); the test-case generator writes
  ``assert`` lines. Its reward is 0 unless every generated test passes the reference solution;
  otherwise the fraction of solver candidates the tests judge right (they pass the generated
  tests exactly when they pass all hidden tests).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from astraflow.rollout.engines.base import Completion, GenerationRequest
from astraflow.rollout.rewards import Reward, extract_code
from astraflow.rollout.workflows.base import Evaluation, PolicyHandle, by_policy, make_trajectory, min_version
from astraflow.rollout.workflows.options import SolverSelectorOptions, SolverTestgenOptions, SolverVerifierOptions
from astraflow.rollout.workflows.registry import register_workflow
from astraflow.streams.messages import Task, Trajectory


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
                                rewards[k][i], c.finish_reason, node_id, {"role": "solver"})
                for k, t in enumerate(tasks) for i, c in enumerate(comps[k])]


@register_workflow("solver_verifier", SolverVerifierOptions)
class SolverVerifier(_TwoPolicy):
    policies = ("solver", "verifier")

    @staticmethod
    def prompt(task: Task, answer: str) -> str:
        return f"{task.prompt}{answer.strip()}\nCorrect? "

    def run_pair(self, tasks: list[Task], hs: PolicyHandle, solver: str, hv: PolicyHandle, verifier: str, node_id: str) -> list[Trajectory]:
        comps, texts = self.solve(tasks, hs, solver, node_id)
        rewards = [[self.reward(x, t.meta) for x in xs] for t, xs in zip(tasks, texts)]
        out = self.solver_trajectories(tasks, hs, solver, comps, rewards, node_id)
        vprompts = [[hv.encode(self.prompt(t, x)) for x in xs] for t, xs in zip(tasks, texts)]
        vreqs = [GenerationRequest(p, hv.params) for ps in vprompts for p in ps]
        vcomps = iter(hv.generate(vreqs, max(min_version(t, verifier) for t in tasks)))
        for k, t in enumerate(tasks):
            for i in range(t.group_size):
                c = next(vcomps)
                verdict = parse_verdict(hv.decode(c.token_ids))
                truth = rewards[k][i] >= 0.5
                out.append(make_trajectory(t, verifier, i, t.group_size, vprompts[k][i], c.token_ids, c.logprobs, c.versions, None,
                                           1.0 if verdict is not None and verdict == truth else 0.0, c.finish_reason, node_id,
                                           {"role": "verifier", "judged": f"{t.task_id}.{solver}.{i}", "verdict": verdict, "truth": truth}))
        return out


@register_workflow("solver_selector", SolverSelectorOptions)
class SolverSelector(_TwoPolicy):
    policies = ("solver", "selector")

    @staticmethod
    def prompt(task: Task, answers: list[str]) -> str:
        listed = "\n".join(f"{n + 1}: {a.strip()}" for n, a in enumerate(answers))
        return f"{task.prompt}\n{listed}\nBest: "

    def run_pair(self, tasks: list[Task], hs: PolicyHandle, solver: str, hsel: PolicyHandle, selector: str, node_id: str) -> list[Trajectory]:
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
                                           {"role": "selector", "choice": choice}))
        return out


@register_workflow("solver_testgen", SolverTestgenOptions)
class SolverTestgen(_TwoPolicy):
    policies = ("solver", "testgen")

    @staticmethod
    def prompt(task: Task) -> str:
        return f"{task.prompt}\nWrite assert statements that test a correct solution:\n"

    @staticmethod
    def parse_tests(text: str) -> list[str]:
        return [line.strip() for line in extract_code(text).splitlines() if line.strip().startswith("assert ")]

    def run_pair(self, tasks: list[Task], hs: PolicyHandle, solver: str, hg: PolicyHandle, gen: str, node_id: str) -> list[Trajectory]:
        from astraflow.rollout.rewards.sandbox import Sandbox

        comps, texts = self.solve(tasks, hs, solver, node_id)
        box = Sandbox()
        hidden_pass = [[box.run(extract_code(x), list(t.meta["tests"])).passed for x in xs] for t, xs in zip(tasks, texts)]
        rewards = [[sum(p) / len(p) if p else 0.0 for p in ps] for ps in hidden_pass]
        out = self.solver_trajectories(tasks, hs, solver, comps, rewards, node_id)
        gprompts = [hg.encode(self.prompt(t)) for t in tasks]
        greqs = [GenerationRequest(p, hg.params) for p, t in zip(gprompts, tasks) for _ in range(t.group_size)]
        gcomps = iter(hg.generate(greqs, max(min_version(t, gen) for t in tasks)))
        for k, t in enumerate(tasks):
            for i in range(t.group_size):
                c = next(gcomps)
                tests = self.parse_tests(hg.decode(c.token_ids))
                valid = bool(tests) and all(box.run(t.meta["reference"], tests).passed)
                reward = 0.0
                if valid:
                    judged = [all(box.run(extract_code(x), tests).passed) == all(hp) for x, hp in zip(texts[k], hidden_pass[k])]
                    reward = sum(judged) / len(judged)
                out.append(make_trajectory(t, gen, i, t.group_size, gprompts[k], c.token_ids, c.logprobs, c.versions, None, reward,
                                           c.finish_reason, node_id, {"role": "testgen", "tests": len(tests), "valid": valid}))
        return out
