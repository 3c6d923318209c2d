"""Periodic evaluation: the avg@k / pass@k maths, and the evaluator's functions on a tiny real model."""

from __future__ import annotations

import asyncio
import io
import math

import pytest
from rich.console import Console
from weights_helpers import Trainer, node

from astraflow.config import parse_recipe
from astraflow.launch.report import summarize
from astraflow.launch.rundir import RunDir
from astraflow.launch.watcher import RunWatcher
from astraflow.rollout import evaluator
from astraflow.rollout.evaluator import evaluate, evaluate_with_workflow, reach
from astraflow.rollout.node import make_handle
from astraflow.rollout.scores import pass_at_k, sample_metrics
from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.state import EvalRecord
from astraflow.tasks import load_split
from astraflow.weights.publish import WeightPublisher
from astraflow.weights.sync import WeightSyncError


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0  # n == k: any passing sample
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 is the pass rate
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))
    assert pass_at_k(2, 1, 4) == 1.0  # fewer samples than k: clamp k to n
    assert pass_at_k(0, 0, 1) == 0.0


def test_sample_metrics():
    got = sample_metrics([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.5]], k=3)
    assert got["avg@k"] == pytest.approx(3.5 / 9)
    assert got["pass@k"] == pytest.approx(2 / 3)
    assert sample_metrics([[0.9, 0.99]], k=2)["pass@k"] == 0.0  # passing means reward >= 1
    assert sample_metrics([], k=2) == {"avg@k": 0.0, "pass@k": 0.0}


def _setup(k: int, workflow: str = "single_turn"):
    recipe = parse_recipe({"name": "e", "workflow": workflow, "data": {"n_train": 4, "n_eval": 3},
                           "rollout": {"max_new_tokens": 3}, "eval": {"k": k, "temperature": 1.0}})
    handle = make_handle(recipe, "solver")
    handle.engine.set_version(0)  # as after the evaluator's sync.goto(0)
    return recipe, handle, load_split(recipe.data)[1]


def _check(result: dict[str, float], k: int) -> None:
    assert {"reward", "avg@k", "pass@k", "n", "k"} <= set(result)
    assert result["n"] == 3 and result["k"] == k
    for key in ("reward", "avg@k", "pass@k"):
        assert 0.0 <= result[key] <= 1.0


def test_evaluate_with_workflow_tiny_model():
    recipe, handle, held_out = _setup(k=3)
    _check(evaluate_with_workflow(recipe, handle, "solver", held_out), 3)
    calls = []
    engine_generate = handle.engine.generate
    handle.engine.generate = lambda reqs: calls.append([r.params.temperature for r in reqs]) or engine_generate(reqs)
    evaluate_with_workflow(recipe, handle, "solver", held_out)
    assert calls == [[0.0] * 3, [1.0] * 9]  # greedy once per prompt, then k samples per prompt


def test_evaluate_single_turn_tiny_model_and_k1_is_greedy():
    recipe, handle, held_out = _setup(k=2)
    _check(evaluate(handle, held_out, recipe.reward, 3, k=2, temperature=1.0), 2)
    one = evaluate(handle, held_out, recipe.reward, 3)  # k = 1: the greedy answer is the only sample
    assert one["avg@k"] == one["reward"] and one["k"] == 1.0


def test_writing_a_workflow_example(repo_root):
    """The complete example of docs/writing-a-workflow.md registers and runs as written."""
    import re
    import sys
    import types

    blocks = re.findall(r"```python\n(.*?)```", (repo_root / "docs/writing-a-workflow.md").read_text(), re.S)
    example, usage = blocks[-2], blocks[-1]
    module = types.ModuleType("doc_example")  # the example is a plug-in module: imported, so its annotations resolve
    sys.modules[module.__name__] = module
    try:
        exec(compile(example, "writing-a-workflow.md", "exec", dont_inherit=True), module.__dict__)
        exec(compile(usage, "writing-a-workflow.md", "exec", dont_inherit=True), module.__dict__)
    finally:
        del sys.modules[module.__name__]


async def test_a_version_gone_from_the_history_is_skipped_with_why_and_the_run_still_finishes(nats_server, run_id, tmp_path,
                                                                                                monkeypatch):
    """An evaluator that falls more than ``weights_history`` versions behind cannot evaluate the trimmed ones: each gets
    a record saying why (not a crash at every restart), the launcher counts it done and the summary names it. A version
    not reached yet is waited for; one that never comes fails after the patience."""
    plane = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "evaluator")
    try:
        await plane.ensure_topology(Topology(policies=("solver",), weights_history=3))
        trainer, pub = Trainer(), WeightPublisher(plane, "solver", keyframe_every=4, keep_versions=None)
        for v in range(6):  # the stream keeps v3..v5; v3 builds on keyframe v0, whose announcement is gone
            await pub.publish(trainer.step() if v else trainer.model.state_dict(), v)
        sync, stop = node(plane), asyncio.Event()
        gone = await reach(sync, 1, stop)
        assert gone is not None and "keeps v3 and later" in gone
        assert "builds on keyframe v0" in (await reach(sync, 3, stop) or "")
        assert await reach(sync, 5, stop) is None and sync.version == 5

        async def later() -> None:
            await asyncio.sleep(1.0)
            await pub.publish(trainer.step(), 6)

        publishing = asyncio.create_task(later())
        assert await reach(sync, 6, stop) is None and sync.version == 6  # announced while it waited
        await publishing
        monkeypatch.setattr(evaluator, "GOTO_PATIENCE_S", 1.0)
        with pytest.raises(WeightSyncError, match="never announced"):
            await reach(sync, 9, stop)

        r = parse_recipe({"name": "e", "eval": {"every": 5}, "trainer": {"steps": 5}})
        rundir = RunDir(tmp_path / "run")
        rundir.prepare()
        watcher = RunWatcher(plane, r, rundir, {0, 5})
        await plane.state.put(EvalRecord(policy="solver", version=0, reward=0.0, skipped=gone))
        await plane.state.put(EvalRecord(policy="solver", version=5, reward=0.25))
        watcher.live.versions["solver"] = 5
        await watcher._poll_evals()
        assert watcher.wanted_evals <= watcher._evals and watcher.live.evals == {5: 0.25}
        await watcher.stop()
        summary = summarize(r, rundir, Console(file=io.StringIO()))
        assert summary["evals_skipped"] == {"solver v0": gone} and summary["held_out_reward"] == {"5": 0.25}
    finally:
        await plane.close()
