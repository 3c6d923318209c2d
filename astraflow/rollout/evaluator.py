"""Held-out evaluation as its own process: it follows the weight stream and never stalls training.

It steps through versions 0, ``every``, 2·``every``, … and the last, plays each held-out prompt
once with greedy decoding and records the mean reward (``reward``) in the run-state KV
(``eval.{policy}.{version}``) where the launcher and ``status`` read it. With ``eval.k`` > 1
each prompt is also sampled k times at ``eval.temperature``: ``avg@k`` is the mean reward over
all samples, ``pass@k`` the mean over prompts of the unbiased estimator
``1 - C(n-c, k) / C(n, k)`` with n = k samples and c of them with reward >= 1 (so: the fraction
of prompts with at least one passing sample). With k = 1 both equal the greedy numbers. The
workflow says how it is evaluated (``Workflow.evaluation``): ``workflow`` plays each prompt
through the recipe's own workflow, so a tool-using agent is scored with its tools;
``single_turn`` scores the evaluated policy's single-turn answers with the recipe's reward
(multi-policy workflows, external agents); agent code in the node (``openai_agent``) is played
through a facade over the evaluator's weights; ``team`` lets the workflow score every policy and the team
(``solver_verifier``: the solver, the verifier's accuracy, and the answer the verifier picks out of
k samples against the solver alone at the same k), each under its own subject
(``eval.{policy}.{version}``, ``eval.team.{version}``), every policy held at the same version.

Held-out problems pass the rollout node's task checks first (``task_checks.py``: a prompt the
model can hold, a ``meta`` the reward can score); one that fails is left out with its reason
logged, so a bad problem never stops evaluations (``n`` in the record counts those scored).

A version the evaluator reaches too late (more than ``plane.weights_history`` versions behind: its announcement, or
the keyframe its chain starts from, trimmed from the stream) can no longer be evaluated. It gets a record all the same,
with ``skipped`` saying why and no figures, so the run finishes and its summary shows the gap, instead of the
evaluator failing on it at every restart. Other failures to reach a version (a history read during a cluster's
election) are tried again for ``GOTO_PATIENCE_S``, then raised (the supervisor restarts the evaluator).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from astraflow.config import Recipe
from astraflow.metrics import Metrics, serving
from astraflow.models import decode_text, encode_prompt, load_tokenizer
from astraflow.role import Role, RoleOptions
from astraflow.rollout.engines.base import GenerationRequest, SamplingParams
from astraflow.rollout.eval_plan import eval_subjects, eval_versions
from astraflow.rollout.node import make_handle
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.scores import sample_metrics
from astraflow.rollout.task_checks import TaskRules, check_content, check_prompt
from astraflow.rollout.workflows.registry import evaluation_of, get_workflow, workflow_class
from astraflow.runtime import lower_priority
from astraflow.streams.messages import HEARTBEAT_PERIOD_S, EvaluatorStats, Heartbeat
from astraflow.streams.plane import Plane
from astraflow.streams.retry import UNANSWERED
from astraflow.streams.state import EvalRecord, StateSchemaError, VersionRecord
from astraflow.tasks import Problem, load_split
from astraflow.weights.sync import VersionGone, WeightSync, WeightSyncError

log = logging.getLogger(__name__)
GOTO_PATIENCE_S = 60.0  # how long an announced version may stay out of reach (a cluster electing a leader) before a restart


def _summary(greedy: list[float], samples: list[list[float]] | None, k: int) -> dict[str, float]:
    out = {"reward": sum(greedy) / max(1, len(greedy)), "n": float(len(greedy)), "k": float(k)}
    if samples is not None:
        out.update(sample_metrics(samples, k))
    else:  # k == 1: the greedy answer is the only sample
        out.update(sample_metrics([[r] for r in greedy], 1))
    return out


def evaluate_with_workflow(recipe: Recipe, handle: Any, policy: str, problems: list[Any], k: int | None = None,
                           temperature: float | None = None) -> dict[str, float]:
    """Each held-out prompt played once greedily (``reward``) and, with k > 1, k times sampled at ``temperature``
    (``avg@k``, ``pass@k``), through the recipe's workflow."""
    from dataclasses import replace

    from astraflow.streams.messages import Task

    k = recipe.eval.k if k is None else k
    temperature = recipe.eval.temperature if temperature is None else temperature
    workflow = get_workflow(recipe.workflow_options, get_reward(recipe.reward))

    def play(params: SamplingParams, group: int, tag: str) -> list[list[float]]:
        h = replace(handle, params=params)
        tasks = [Task(task_id=f"{tag}-{i}", workflow=recipe.workflow, policy=policy, prompt_id=p.prompt_id, prompt=p.prompt,
                      group_size=group, meta=p.meta) for i, p in enumerate(problems)]
        scores: dict[str, list[float]] = {t.task_id: [] for t in tasks}
        for t in workflow.run(tasks, {policy: h}, "evaluator"):
            if t.policy == policy and t.task_id in scores:
                scores[t.task_id].append(t.reward or 0.0)
        return [s for s in scores.values() if s]

    try:
        greedy = [r for s in play(SamplingParams(recipe.rollout.max_new_tokens, temperature=0.0), 1, "eval") for r in s[:1]]
        samples = None
        if k > 1:
            params = SamplingParams(recipe.rollout.max_new_tokens, temperature=temperature, top_p=recipe.rollout.top_p)
            samples = play(params, k, "eval-k")
    finally:
        close = getattr(workflow, "close", None)  # one that serves an endpoint (openai_agent) lets it go
        if close is not None:
            close()
    return _summary(greedy, samples, k)


def evaluate(handle: Any, problems: list[Any], reward_name: str, max_new_tokens: int, k: int = 1,
             temperature: float = 1.0, top_p: float = 1.0) -> dict[str, float]:
    """Single-turn: each prompt answered greedily (``reward``) and, with k > 1, sampled k times (``avg@k``, ``pass@k``)."""
    reward = get_reward(reward_name)
    prompts = [encode_prompt(handle.tokenizer, p.prompt) for p in problems]

    def score(c: Any, p: Any) -> float:
        return reward(decode_text(handle.tokenizer, c.token_ids), p.meta)

    greedy_params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    comps = handle.engine.generate([GenerationRequest(ids, greedy_params) for ids in prompts])
    greedy = [score(c, p) for c, p in zip(comps, problems)]
    samples = None
    if k > 1:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        comps = iter(handle.engine.generate([GenerationRequest(ids, params) for ids in prompts for _ in range(k)]))
        samples = [[score(next(comps), p) for _ in range(k)] for p in problems]
    return _summary(greedy, samples, k)


def scorable(recipe: Recipe, problems: list[Problem]) -> list[Problem]:
    """The problems a rollout node would play (``task_checks``: prompt length and fit, the reward's meta check);
    each one left out is logged with its reason. None left is a bad data set: that raises."""
    single_turn = evaluation_of(recipe.workflow, recipe.workflow_options) == "single_turn"
    uses_reward = getattr(workflow_class(recipe.workflow), "uses_reward", True) or single_turn
    rules = TaskRules.of(recipe, uses_reward)

    def count(policy: str, text: str) -> int:
        return len(encode_prompt(load_tokenizer(recipe.policies[policy].model.tokenizer), text))

    out = []
    for p in problems:
        problem = check_content(p.prompt, p.meta, rules) or check_prompt(p.prompt, rules, count)
        if problem is None:
            out.append(p)
        else:
            log.warning("held-out problem %s left out: %s", p.prompt_id, problem.reason)
    if problems and not out:
        raise ValueError(f"no held-out problem can be evaluated: {len(problems)} fail the task checks (see the log)")
    return out


def export_eval(metrics: Metrics, result: dict[str, float], version: int, held: int, seconds: float) -> None:
    """The last evaluation as gauges (``astraflow_evaluator_{reward,avg_at_k,pass_at_k,k,evaluated_version,version}``)
    and counters (``astraflow_evaluator_{evaluations,eval_seconds}_total``)."""
    metrics.set({"reward": result["reward"], "avg_at_k": result["avg@k"], "pass_at_k": result["pass@k"],
                 "k": result["k"], "evaluated_version": version, "version": held})
    metrics.inc({"evaluations": 1, "eval_seconds": seconds})


async def evaluated(plane: Plane, policy: str, version: int) -> bool:
    """An evaluation of ``version`` is recorded already (a restarted evaluator skips it). A value that is not a
    valid record is evaluated again and overwritten, not trusted and not fatal."""
    try:
        return await plane.state.get(EvalRecord, policy, version) is not None
    except StateSchemaError as e:
        log.warning("evaluation of %s v%d is not a valid record (%s): evaluating it again", policy, version, e)
        return False


async def _announced(plane: Plane, policy: str) -> int:
    record = await plane.state.get(VersionRecord, policy)
    return record.version if record is not None else -1


def evaluate_team(recipe: Recipe, handles: dict[str, Any], problems: list[Any]) -> dict[str, dict[str, float]]:
    """A team workflow's own held-out evaluation, every policy at the version the evaluator holds."""
    workflow = get_workflow(recipe.workflow_options, get_reward(recipe.reward))
    return workflow.evaluate(problems, handles, recipe.eval.k, recipe.eval.temperature)  # type: ignore[attr-defined]


async def serve(recipe: Recipe, options: RoleOptions) -> None:
    torch.set_num_threads(recipe.rollout.threads)
    policy = recipe.eval_policy
    team = evaluation_of(recipe.workflow, recipe.workflow_options) == "team"
    async with Role("evaluator", options, recipe.plane.server_gone_timeout, policy=policy) as role:
        plane = role.plane
        await plane.ensure_topology(recipe.topology(), create=False)
        followed = recipe.policy_names if team else (policy,)  # a team is evaluated with every policy at the same version
        handles = {p: make_handle(recipe, p) for p in followed}
        for h in handles.values():
            role.on_exit(h.engine.close)
        syncs = {p: WeightSync(plane, p, handles[p].engine) for p in followed}
        held_out = scorable(recipe, load_split(recipe.data)[1])
        role.started()
        if lower_priority(recipe.eval.nice):
            log.info("evaluator at nice %d from now on", recipe.eval.nice)
        done: list[tuple[int, float]] = []

        async def beat() -> None:
            last = done[-1] if done else (-1, 0.0)
            stats = EvaluatorStats(evaluated=len(done), last_version=last[0], last_reward=last[1])
            await plane.beat(Heartbeat(worker_id=options.worker_id, policy=policy, version=syncs[policy].version, stats=stats,
                                       metrics=serving()))

        role.every(HEARTBEAT_PERIOD_S, beat)
        for v in eval_versions(recipe):
            at = {p: min(v, recipe.policies[p].trainer.steps) for p in followed}
            while not role.stop.is_set() and any([await _announced(plane, p) < at[p] for p in followed]):
                await asyncio.sleep(0.5)
            if role.stop.is_set():
                break
            if await evaluated(plane, eval_subjects(recipe)[-1], v):
                continue  # already evaluated (a restarted evaluator)
            gone = [why for p in followed if (why := await reach(syncs[p], at[p], role.stop))]
            if gone:
                for subject in eval_subjects(recipe):
                    await plane.state.put(EvalRecord(policy=subject, version=v, reward=0.0, skipped="; ".join(gone)))
                log.warning("eval v%d skipped: %s", v, "; ".join(gone))
                continue
            t0 = time.perf_counter()
            results = await _evaluate(recipe, handles, held_out, team)
            elapsed = time.perf_counter() - t0
            for subject, result in results.items():  # the last subject last: its record says the version is done
                await plane.state.put(EvalRecord(policy=subject, version=v, **result))
                log.info("eval %s v%d: held-out reward %.3f, avg@%d %.3f, pass@%d %.3f", subject, v, result["reward"],
                         recipe.eval.k, result["avg@k"], recipe.eval.k, result["pass@k"])
            done.append((v, results[policy]["reward"]))
            if role.metrics is not None:
                export_eval(role.metrics, results[policy], v, syncs[policy].version, elapsed)


async def reach(sync: WeightSync, version: int, stop: asyncio.Event) -> str | None:
    """Bring ``sync``'s engine to ``version``: None once there, or why the version is gone for good (``VersionGone``).
    Any other failure is tried again, with doubling pauses, for up to ``GOTO_PATIENCE_S``, then raised."""
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + GOTO_PATIENCE_S, 0.5
    while True:
        try:
            await sync.goto(version)
            return None
        except VersionGone as e:
            return str(e)
        except (WeightSyncError, *UNANSWERED) as e:  # the plane not answering: also a history read cut short (a timeout)
            if stop.is_set() or loop.time() + pause > deadline:
                raise
            log.warning("%s; trying again in %.1fs", e, pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, 8.0)


async def _evaluate(recipe: Recipe, handles: dict[str, Any], held_out: list[Any], team: bool) -> dict[str, dict[str, float]]:
    """One evaluation of the versions ``handles`` hold: per subject (the policy, or a team's), its figures."""
    policy, ev = recipe.eval_policy, recipe.eval
    if team:
        return await asyncio.to_thread(evaluate_team, recipe, handles, held_out)
    if evaluation_of(recipe.workflow, recipe.workflow_options) == "workflow":
        return {policy: await asyncio.to_thread(evaluate_with_workflow, recipe, handles[policy], policy, held_out)}
    return {policy: await asyncio.to_thread(evaluate, handles[policy], held_out, recipe.reward, recipe.rollout.max_new_tokens, ev.k,
                                            ev.temperature, recipe.rollout.top_p)}
