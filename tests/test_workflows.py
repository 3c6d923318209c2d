"""Workflows on a scripted engine: tool calls, masking, per-token versions, environments over HTTP."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from factories import a_task

from astraflow.models import load_tokenizer
from astraflow.rollout.engines.base import SamplingParams, StaleWeights
from astraflow.rollout.engines.testing import ScriptEngine
from astraflow.rollout.envs.games import Rooms
from astraflow.rollout.envs.server import serve_in_thread
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.registry import get_workflow
from astraflow.rollout.workflows.tools import parse_tool_call
from astraflow.streams.codec import decode, encode
from astraflow.streams.messages import Task, Trajectory

TOK = load_tokenizer("byt5")


def handle(reply, version: int = 0, max_new_tokens: int = 128, name: str = "solver") -> PolicyHandle:
    return PolicyHandle(ScriptEngine(TOK, reply, version), TOK, SamplingParams(max_new_tokens=max_new_tokens), name=name)


def task(i: int = 0, prompt: str = "What is 12*7? ", answer: str = "84", group: int = 2, **kw) -> Task:
    return a_task(f"t{i}", workflow="w", prompt_id=f"p{i}", prompt=prompt, group_size=group, meta={"answer": answer, **kw.pop("meta", {})},
                  **kw)


def text_of(ids: np.ndarray) -> str:
    return TOK.decode(ids.tolist(), skip_special_tokens=True)


def segments(t: Trajectory) -> list[tuple[int, str]]:
    """(mask, text) runs of a trajectory's completion."""
    ids, mask = t.completion(), t.mask()
    out: list[tuple[int, str]] = []
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            out.append((int(mask[start]), text_of(ids[start:k])))
            start = k
    return out


def test_tool_call_parsing():
    assert parse_tool_call("let me <tool>calculator(2 + 3)</tool>") == ("calculator", "2 + 3")
    assert parse_tool_call('<tool>{"name": "search", "arguments": {"q": "nile"}}</tool>') == ("search", '{"q": "nile"}')
    assert parse_tool_call("<tool>not a call</tool>") is None
    assert parse_tool_call("no tool here") is None


def test_single_turn_is_registered_and_scores():
    wf = get_workflow("single_turn", get_reward("arithmetic"))
    trajs = wf.run([task(answer="5", prompt="2+3=")], {"solver": handle(lambda p: "5")}, "n0")
    assert [t.traj_id for t in trajs] == ["t0.solver.0", "t0.solver.1"]
    assert all(t.reward == 1.0 and t.mask().all() for t in trajs)


def test_multi_turn_tools_masks_tool_output_and_keeps_true_versions():
    def reply(prompt: str) -> str:
        return "<tool>calculator(12*7)</tool>" if "<result>" not in prompt else "84"

    h = handle(reply)
    refreshed = []

    def safe_point() -> bool:  # the node applies v1 between the turns
        h.engine.load_state({}, 1)
        refreshed.append(True)
        return True

    h.safe_point_fn = safe_point
    wf = get_workflow({"type": "multi_turn_tools", "max_turns": 3}, get_reward("arithmetic"))
    trajs = wf.run([task(group=2)], {"solver": h}, "n0")
    assert len(trajs) == 2 and refreshed
    t = trajs[0]
    assert segments(t) == [(1, "<tool>calculator(12*7)</tool>"), (0, "<result>84</result>"), (1, "84")]
    assert t.reward == 1.0 and t.meta["tool_calls"] == 1 and t.meta["turns"] == 2
    versions, mask, lp = t.token_versions(), t.mask(), t.behaviour_logprobs()
    first_turn = len(TOK("<tool>calculator(12*7)</tool>", add_special_tokens=False)["input_ids"])
    assert set(versions[:first_turn]) == {0}  # generated before the refresh
    assert set(versions[mask == 0]) == {0}  # inserted tokens: the version of the turn before them
    assert set(versions[first_turn:][mask[first_turn:] == 1]) == {1}  # generated after the refresh
    assert np.all(lp[mask == 0] == 0.0) and np.all(lp[mask == 1] == -0.25)
    assert t.min_version == 0
    assert decode(encode(t), Trajectory) == t  # still a valid wire message


def test_tools_errors_json_calls_and_turn_limit():
    def reply(prompt: str) -> str:
        n = prompt.count("<result>")
        return ['<tool>{"name": "search", "arguments": "capital of France"}</tool>', "<tool>rm(-rf)</tool>",
                "<tool>calculator(2**999)</tool>"][min(n, 2)]

    wf = get_workflow({"type": "multi_turn_tools", "max_turns": 3}, get_reward("qa_em"))
    (t,) = wf.run([task(group=1, answer="x")], {"solver": handle(reply)}, "n0")
    inserted = [s for m, s in segments(t) if m == 0]
    assert inserted[0] == "<result>Paris is the capital of France.</result>"
    assert "unknown tool 'rm'" in inserted[1]
    assert len(inserted) == 2 and t.finish_reason == "length"  # the third turn still wanted a tool: out of turns


def test_refuses_to_generate_with_weights_older_than_the_task_allows():
    wf = get_workflow("single_turn", get_reward("arithmetic"))
    with pytest.raises(StaleWeights):
        wf.run([task(min_versions={"solver": 3})], {"solver": handle(lambda p: "1", version=2)}, "n0")


@pytest.fixture(scope="module")
def env_server():
    server = serve_in_thread()
    yield server
    server.shutdown()


def rooms_player(seed: int):
    """A scripted agent that knows the room layout of ``seed`` and plays the shortest solution."""
    game = Rooms(seed)
    plan = [f"go to {game.where[game.goal_obj]}", f"take {game.goal_obj}", f"go to {game.goal_room}",
            f"put {game.goal_obj} in {game.goal_rec}"]
    return lambda prompt: plan[min(prompt.count("\n> ") - 1, len(plan) - 1)] + "\n"


def test_env_http_plays_episodes_against_the_bundled_server(env_server):
    wf = get_workflow({"type": "env_http", "url": env_server.url, "env": "rooms", "max_turns": 6}, get_reward("arithmetic"))
    before = dict(env_server.stats)
    trajs = wf.run([task(group=2, meta={"seed": 7})], {"solver": handle(rooms_player(7))}, "n0")
    assert [t.reward for t in trajs] == [1.0, 1.0] and all(t.meta["steps"] == 4 for t in trajs)
    segs = segments(trajs[0])
    assert [m for m, _ in segs] == [1, 0, 1, 0, 1, 0, 1]  # action, observation, … , final action
    assert segs[0][1] == rooms_player(7)("x\n> ")
    assert "You take the" in segs[3][1]
    assert env_server.stats["closed"] - before["closed"] == env_server.stats["started"] - before["started"] == 2
    assert not env_server.episodes


def test_env_http_episode_that_never_finishes_is_cut_at_max_turns(env_server):
    wf = get_workflow({"type": "env_http", "url": env_server.url, "env": "shop", "max_turns": 3}, get_reward("arithmetic"))
    (t,) = wf.run([task(group=1)], {"solver": handle(lambda p: "dance\n")}, "n0")
    assert t.reward == 0.0 and t.finish_reason == "length" and t.meta["steps"] == 3
    assert "Unknown action" in segments(t)[1][1]


@pytest.mark.parametrize("context", [120, 200])
def test_episodes_never_outgrow_the_models_context(env_server, context: int):
    """An untrained policy babbles and observations pile up: the episode ends at the context, never past it."""
    h = replace(handle(lambda p: "look around the room and think about it\n", max_new_tokens=24), context=context)
    env = get_workflow({"type": "env_http", "url": env_server.url, "env": "shop", "max_turns": 12}, get_reward("arithmetic"))
    tools = get_workflow({"type": "multi_turn_tools", "max_turns": 12}, get_reward("qa_em"))
    caller = replace(handle(lambda p: "<tool>search(capital of France)</tool>", max_new_tokens=48), context=context)
    trajs = env.run([task(group=2, meta={"seed": 3})], {"solver": h}, "n0")
    trajs += tools.run([task(group=1, answer="x")], {"solver": caller}, "n0")
    for t in trajs:
        assert len(t.prompt_ids) // 4 + len(t.completion_ids) // 4 <= context and t.finish_reason == "length"
    assert any(len(t.prompt_ids) // 4 + len(t.completion_ids) // 4 == context for t in trajs)  # filled, then cut


def test_env_http_shop_pays_attribute_match(env_server):
    def shopper(prompt: str) -> str:
        want = re.search(r"buy a (\w+) (\w+) (\w+)", prompt).groups()
        if "Results:" not in prompt:
            return f"search[{' '.join(want)}]\n"
        if "Item " not in prompt:
            first = re.search(r"Results: (i\d+)", prompt).group(1)
            return f"click[{first}]\n"
        return "buy\n"

    wf = get_workflow({"type": "env_http", "url": env_server.url, "env": "shop", "max_turns": 4}, get_reward("arithmetic"))
    (t,) = wf.run([task(group=1)], {"solver": handle(shopper)}, "n0")
    assert t.reward == 1.0 and t.finish_reason == "stop"
