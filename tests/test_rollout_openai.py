"""The OpenAI-compatible facade as real clients use it (the official ``openai`` client), and agents trained through it."""

from __future__ import annotations

import socket

import numpy as np
import openai
import pytest

from astraflow.config import ModelConfig
from astraflow.models import build_model, encode_prompt, load_tokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.hf import HFEngine
from astraflow.rollout.engines.testing import ScriptEngine
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.openai_agent import OpenAIAgent
from astraflow.rollout.workflows.openai_facade import ChatFacade
from astraflow.rollout.workflows.options import OpenAIAgentOptions
from astraflow.streams.messages import Task

TOK = load_tokenizer("byt5")
USER = [{"role": "user", "content": "hi"}]


def client(base_url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)


def scripted(reply, version: int = 3) -> PolicyHandle:
    return PolicyHandle(ScriptEngine(TOK, reply, version=version), TOK, SamplingParams(max_new_tokens=32), name="solver")


def tiny_model(max_new_tokens: int = 6) -> PolicyHandle:
    cfg = ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    engine = HFEngine(build_model(cfg, TOK), TOK)
    engine.set_version(0)
    return PolicyHandle(engine, TOK, SamplingParams(max_new_tokens=max_new_tokens), name="solver")


@pytest.fixture
def facade():
    f = ChatFacade({"solver": scripted(lambda p: "hello")})
    yield f
    f.close()


def test_chat_completion_parsed_by_the_official_client_and_recorded(facade: ChatFacade):
    token = facade.open_sample("solver")
    out = client(facade.base_url(token)).chat.completions.create(model="m", messages=USER, n=2, logprobs=True)
    assert len(out.choices) == 2 and out.choices[1].index == 1
    assert out.choices[0].message.content == "hello" and out.choices[0].finish_reason == "stop"
    lps = out.choices[0].logprobs.content
    assert [x.logprob for x in lps] == [-0.25] * 6 and "".join(x.token for x in lps[:5]) == "hello"  # + EOS: what is trained
    prompt = len(facade.close_sample(token)[0].prompt_ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (prompt, 12, prompt + 12)  # n=2
    assert out.system_fingerprint == "astraflow-v3"
    assert [m.id for m in client(f"{facade.url}/v1").models.list()] == ["solver"]


def test_calls_under_a_sample_are_recorded_with_tokens_logprobs_and_versions(facade: ChatFacade):
    token = facade.open_sample("solver")
    client(facade.base_url(token)).chat.completions.create(model="m", messages=USER)
    (call,) = facade.close_sample(token)
    assert call.versions == [3] * 6 and call.logprobs == [-0.25] * 6 and call.completion_ids[-1] == TOK.eos_token_id
    assert call.on_policy and call.text == "hello"
    with pytest.raises(openai.NotFoundError):  # a closed sample takes no more calls
        client(facade.base_url(token)).chat.completions.create(model="m", messages=USER)


def test_streaming_chat_is_served_as_server_sent_events(facade: ChatFacade):
    token = facade.open_sample("solver")
    stream = client(facade.base_url(token)).chat.completions.create(model="m", messages=USER, n=2, stream=True,
                                                                    stream_options={"include_usage": True})
    text: dict[int, str] = {}
    finish, usage = {}, None
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
        usage = chunk.usage or usage
    assert text == {0: "hello", 1: "hello"} and finish == {0: "stop", 1: "stop"}
    assert usage is not None and usage.completion_tokens == 12
    assert len(facade.close_sample(token)) == 2  # recorded like any call


def test_completions_take_text_or_token_ids_and_stream(facade: ChatFacade):
    token = facade.open_sample("solver")
    c = client(facade.base_url(token))
    out = c.completions.create(model="m", prompt="2+2=", logprobs=0)
    assert out.choices[0].text == "hello" and out.choices[0].logprobs.token_logprobs == [-0.25] * 6
    ids = encode_prompt(TOK, "2+2=")
    assert c.completions.create(model="m", prompt=ids).choices[0].text == "hello"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="m", prompt="2+2=", stream=True) if ch.choices)
    assert streamed == "hello"
    calls = facade.close_sample(token)
    assert calls[0].prompt_ids == ids == calls[1].prompt_ids  # text is encoded as task prompts are: no EOS


def test_stop_strings_are_trimmed_from_the_content_but_trained():
    f = ChatFacade({"solver": scripted(lambda p: "answer: 4 END ignored")})
    try:
        token = f.open_sample("solver")
        out = client(f.base_url(token)).chat.completions.create(model="m", messages=USER, stop=["END"])
        assert out.choices[0].message.content == "answer: 4 " and out.choices[0].finish_reason == "stop"
        (call,) = f.close_sample(token)
        assert TOK.decode(call.completion_ids, skip_special_tokens=True) == "answer: 4 END"  # the model chose to stop there
    finally:
        f.close()


@pytest.mark.parametrize("kwargs, param", [
    ({"functions": [{"name": "add", "parameters": {"type": "object"}}]}, "functions"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
    ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),
])
def test_what_the_facade_cannot_honour_is_refused_with_a_clear_400(facade: ChatFacade, kwargs: dict, param: str):
    with pytest.raises(openai.BadRequestError) as bad:
        client(f"{facade.url}/v1").chat.completions.create(model="m", messages=USER, **kwargs)
    assert bad.value.body["param"] == param and "not supported" in bad.value.body["message"]


def test_no_op_forms_of_tools_and_formats_are_served(facade: ChatFacade):
    out = client(f"{facade.url}/v1").chat.completions.create(model="m", messages=USER, tool_choice="none",
                                                             response_format={"type": "text"}, user="u", metadata={"a": "b"})
    assert out.choices[0].message.content == "hello"


def test_temperature_zero_is_greedy_and_kept_out_of_the_loss():
    h = tiny_model()
    f = ChatFacade({"solver": h})
    try:
        token = f.open_sample("solver")
        c = client(f.base_url(token))
        greedy = [c.completions.create(model="m", prompt="1+2=", temperature=0).choices[0].text for _ in range(3)]
        c.completions.create(model="m", prompt="1+2=")  # the recipe's distribution
        calls = f.close_sample(token)
    finally:
        f.close()
    assert len(set(greedy)) == 1
    ids = h.encode("1+2=")
    for tok in calls[0].completion_ids[:1]:  # the first greedy token is the argmax of the model's next-token logits
        import torch

        with torch.no_grad():
            logits = h.engine.model(torch.tensor([ids])).logits[0, -1]
        assert tok == int(logits.argmax())
    assert [c.on_policy for c in calls] == [False, False, False, True]


def test_the_endpoint_listens_where_configured_and_asks_for_the_key():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    f = ChatFacade({"solver": scripted(lambda p: "hello")}, host="0.0.0.0", port=port, api_key="s3cret")
    try:
        assert f.url == f"http://{socket.gethostname()}:{port}"  # advertised by name when listening on every interface
        local = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            client(local, "wrong").chat.completions.create(model="m", messages=USER)
        assert client(local, "s3cret").chat.completions.create(model="m", messages=USER).choices[0].message.content == "hello"
        token = f.open_sample("solver")  # a sample's URL is its own capability
        sample_url = f"http://127.0.0.1:{port}/s/{token}/v1"
        assert client(sample_url, "anything").chat.completions.create(model="m", messages=USER).choices
    finally:
        f.close()


# ---------------------------------------------------------------- agents in the node (``agent: module:function``)


def two_step_agent(base_url: str, prompt: str, meta: dict) -> str:
    """'Existing agent code' on the official client: asks, then asks again with the conversation so far."""
    c = client(base_url)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": prompt}]
    first = c.chat.completions.create(model="gpt-x", messages=messages, max_tokens=50)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Only the number, please."}]
    return c.chat.completions.create(model="gpt-x", messages=messages, logprobs=True).choices[0].message.content


def streaming_agent(base_url: str, prompt: str, meta: dict) -> str:
    """Streams its only call (served since SSE; before, the 400 dead-lettered every task of the pull)."""
    stream = client(base_url).chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": prompt}], stream=True)
    return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)


def completions_agent(base_url: str, prompt: str, meta: dict) -> str:
    """Continues its own text with the plain completions endpoint."""
    c = client(base_url)
    first = c.completions.create(model="gpt-x", prompt=prompt).choices[0].text
    return c.completions.create(model="gpt-x", prompt=f"{prompt}{first}\nso: ").choices[0].text


def broken_agent(base_url: str, prompt: str, meta: dict) -> str:
    client(base_url).chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": prompt}])
    raise KeyError("tool_calls")  # e.g. the agent expected a field the model never produced


def silent_agent(base_url: str, prompt: str, meta: dict) -> str:
    raise ConnectionError("could not reach its own tools")  # fails before any model call


def agent_workflow(agent: str, concurrency: int = 4) -> OpenAIAgent:
    """The workflow as a recipe names it: ``{type: openai_agent, agent: "test_rollout_openai:<function>"}``."""
    return OpenAIAgent(get_reward("arithmetic"), OpenAIAgentOptions(agent=f"{__name__}:{agent}", concurrency=concurrency))


def play(agent: str, reply, prompt: str = "3+4=", answer: str = "7"):
    wf = agent_workflow(agent, concurrency=2)
    try:
        task = Task(task_id="t0", workflow="openai_agent", policy="solver", prompt_id="p", prompt=prompt, group_size=1,
                    meta={"answer": answer})
        (t,) = wf.run([task], {"solver": scripted(reply)}, "n0")
    finally:
        wf.close()
    return t


def test_agent_calls_chain_into_one_trajectory_with_context_masked():
    replies = iter(["I think 7", "7"])
    t = play("two_step_agent", lambda p: next(replies))
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


def test_completions_that_extend_the_samples_text_chain():
    replies = iter(["6", "7"])
    t = play("completions_agent", lambda p: next(replies))
    assert t.reward == 1.0 and t.meta["unchained_calls"] == 0 and t.meta["calls"] == 2
    ids, mask = t.completion().tolist(), t.mask()
    assert ids == encode_prompt(TOK, "6") + [TOK.eos_token_id] + encode_prompt(TOK, "\nso: ") + encode_prompt(TOK, "7") + [1]
    assert mask.tolist() == [1, 1] + [0] * 5 + [1, 1]  # the model's tokens (EOS included) trained, the agent's text masked


def test_an_agent_that_streams_trains():
    t = play("streaming_agent", lambda p: "7")
    assert t.reward == 1.0 and t.finish_reason == "stop" and t.meta["calls"] == 1 and t.mask().all()


def test_agent_on_a_real_model_records_its_logprobs():
    wf = agent_workflow("two_step_agent", concurrency=2)
    try:
        tasks = [Task(task_id=f"t{i}", workflow="openai_agent", policy="solver", prompt_id=f"p{i}", prompt=f"{i}+1=", group_size=2,
                      meta={"answer": str(i + 1)}) for i in range(2)]
        trajs = wf.run(tasks, {"solver": tiny_model()}, "n0")
    finally:
        wf.close()
    assert sorted(t.traj_id for t in trajs) == ["t0.solver.0", "t0.solver.1", "t1.solver.0", "t1.solver.1"]
    for t in trajs:
        assert t.meta["calls"] == 2
        gen = t.behaviour_logprobs()[t.mask() == 1]
        assert len(gen) > 0 and np.all(gen <= 0) and np.all(np.isfinite(gen))


@pytest.mark.parametrize("agent, error", [("broken_agent", "KeyError"), ("silent_agent", "ConnectionError")])
def test_an_agent_error_is_a_scored_failure(agent: str, error: str):
    t = play(agent, lambda p: "7")
    assert t.reward == 0.0 and t.finish_reason == "error" and error in t.meta["agent_error"]
