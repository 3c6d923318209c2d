"""The OpenAI-compatible facade: unchanged agent code (plain urllib) trains through a rollout node."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from astraflow.config import ModelConfig
from astraflow.models import build_model, load_tokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.hf import HFEngine
from astraflow.rollout.engines.testing import ScriptEngine
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.openai_agent import ChatFacade, OpenAIAgent
from astraflow.rollout.workflows.options import OpenAIAgentOptions
from astraflow.streams.messages import Task

TOK = load_tokenizer("byt5")


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", "Authorization": "Bearer x"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def two_step_agent(base_url: str, prompt: str, meta: dict) -> str:
    """'Existing agent code': asks, then asks again with the conversation so far, via plain HTTP."""
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": prompt}]
    first = post(f"{base_url}/chat/completions", {"model": "gpt-x", "messages": messages, "temperature": 0.2, "max_tokens": 50})
    messages += [first["choices"][0]["message"], {"role": "user", "content": "Only the number, please."}]
    second = post(f"{base_url}/chat/completions", {"model": "gpt-x", "messages": messages, "logprobs": True})
    return second["choices"][0]["message"]["content"]


def broken_agent(base_url: str, prompt: str, meta: dict) -> str:
    post(f"{base_url}/chat/completions", {"messages": [{"role": "user", "content": prompt}]})
    raise KeyError("tool_calls")  # e.g. the agent expected a field the model never produced


def agent_workflow(agent: str, concurrency: int = 4) -> OpenAIAgent:
    """The workflow as a recipe names it: ``{type: openai_agent, agent: "test_rollout_openai:<function>"}``."""
    return OpenAIAgent(get_reward("arithmetic"), OpenAIAgentOptions(agent=f"{__name__}:{agent}", concurrency=concurrency))


def scripted(reply) -> PolicyHandle:  # noqa: ANN001
    return PolicyHandle(ScriptEngine(TOK, reply, version=3), TOK, SamplingParams(max_new_tokens=32), name="solver")


def test_facade_serves_openai_shapes_and_records_tokens():
    facade = ChatFacade(scripted(lambda p: "hello"), model="solver")
    try:
        url = facade.open("s1")
        out = post(f"{url}/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "logprobs": True})
        assert out["object"] == "chat.completion" and len(out["choices"]) == 2
        assert out["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
        lps = out["choices"][0]["logprobs"]["content"]
        assert [x["logprob"] for x in lps] == [-0.25] * 6 and "".join(x["token"] for x in lps[:5]) == "hello"  # + EOS
        assert out["usage"]["completion_tokens"] == 12 and out["system_fingerprint"] == "astraflow-v3"
        calls = facade.pop("s1")
        assert len(calls) == 2 and calls[0].versions == [3] * 6 and calls[0].completion_ids[-1] == TOK.eos_token_id
        models = json.loads(urllib.request.urlopen(f"{url}/models", timeout=10).read())
        assert models["data"][0]["id"] == "solver"
        with pytest.raises(urllib.error.HTTPError) as bad:
            post(f"{url}/chat/completions", {"model": "m", "messages": []})
        assert bad.value.code == 400
    finally:
        facade.close()


def test_agent_calls_chain_into_one_trajectory_with_context_masked():
    replies = iter(["I think 7", "7"])
    wf = agent_workflow("two_step_agent", concurrency=2)
    h = scripted(lambda p: next(replies))
    try:
        task = Task(task_id="t0", workflow="openai_agent", policy="solver", prompt_id="p", prompt="3+4=", group_size=1, meta={"answer": "7"})
        (t,) = wf.run([task], {"solver": h}, "n0")
    finally:
        wf.close()
    assert t.reward == 1.0 and t.meta == {"turns": 2, "calls": 2, "unchained_calls": 0}
    mask, ids = t.mask(), t.completion()
    text = lambda a: TOK.decode(a.tolist(), skip_special_tokens=True)  # noqa: E731
    first = TOK("I think 7", add_special_tokens=False)["input_ids"]
    assert text(ids[: len(first)]) == "I think 7" and mask[: len(first) + 1].all()  # + its EOS
    assert text(ids[mask == 0]) == "\n<|user|>\nOnly the number, please.\n<|assistant|>\n"
    assert text(ids[-2:]) == "7" and mask[-2:].all()
    assert np.all(t.behaviour_logprobs()[mask == 1] == -0.25) and np.all(t.behaviour_logprobs()[mask == 0] == 0)
    assert set(t.token_versions().tolist()) == {3}
    assert text(t.prompt_tokens()).startswith("<|system|>\nYou add numbers.\n<|user|>\n3+4=")


def test_agent_on_a_real_model_records_its_logprobs():
    cfg = ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    engine = HFEngine(build_model(cfg, TOK), TOK)
    engine.set_version(0)
    h = PolicyHandle(engine, TOK, SamplingParams(max_new_tokens=6), name="solver")
    wf = agent_workflow("two_step_agent", concurrency=2)
    try:
        tasks = [Task(task_id=f"t{i}", workflow="openai_agent", policy="solver", prompt_id=f"p{i}", prompt=f"{i}+1=", group_size=2,
                      meta={"answer": str(i + 1)}) for i in range(2)]
        trajs = wf.run(tasks, {"solver": h}, "n0")
    finally:
        wf.close()
    assert sorted(t.traj_id for t in trajs) == ["t0.solver.0", "t0.solver.1", "t1.solver.0", "t1.solver.1"]
    for t in trajs:
        assert t.meta["calls"] == 2
        gen = t.behaviour_logprobs()[t.mask() == 1]
        assert len(gen) > 0 and np.all(gen <= 0) and np.all(np.isfinite(gen))


def test_agent_error_is_a_scored_episode():
    wf = agent_workflow("broken_agent")
    try:
        task = Task(task_id="t0", workflow="openai_agent", policy="solver", prompt_id="p", prompt="1+1=", group_size=1, meta={"answer": "2"})
        (t,) = wf.run([task], {"solver": scripted(lambda p: "2")}, "n0")
    finally:
        wf.close()
    assert t.reward == 0.0 and "KeyError" in t.meta["agent_error"] and t.finish_reason == "error"
