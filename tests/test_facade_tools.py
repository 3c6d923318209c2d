"""Tool calling through the facade as OpenAI clients do it, and token fidelity across any multi-turn session.

The model is a script engine writing what a trained model would (``<tool_call>{...}</tool_call>`` blocks), so
every answer is known; the client is the official ``openai`` client. The property test drives random sessions
(tool calls, parallel calls, streaming, ``n`` > 1, stop strings, weights moving between calls) and checks that
the trajectory's trained tokens are exactly the tokens the engine sampled, in order, with their logprobs and
versions, and that everything else is masked.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import ByT5Tokenizer

from astraflow.models import load_tokenizer
from astraflow.rollout.engines.base import Completion, GenerationRequest, SamplingParams
from astraflow.rollout.engines.testing import ScriptEngine
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.agent_sessions import Outcome, sample_trajectory
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.openai_facade import ChatFacade
from astraflow.streams.messages import Task

TOK = load_tokenizer("byt5")
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                                       "required": ["a", "b"]}}}
NEG = {"type": "function", "function": {"name": "neg", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
USER = [{"role": "user", "content": "What is 2+3?"}]


def call(name: str, **args: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


class Recording(ScriptEngine):
    """A script engine that keeps what it sampled (the ground truth the trajectory must match)."""

    def __init__(self, replies: deque[str]) -> None:
        super().__init__(TOK, lambda prompt: replies.popleft())
        self.sampled: list[Completion] = []

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        out = super().generate(requests)
        self.sampled += out
        return out


class Model:
    """A facade over a recording script engine; ``say`` queues what the model writes next. ``template``: a chat
    template of the model's own, on a tokenizer of its own (load_tokenizer's is shared)."""

    def __init__(self, template: str | None = None) -> None:
        self.replies: deque[str] = deque()
        self.engine = Recording(self.replies)
        self.tok = TOK
        if template is not None:
            self.tok = ByT5Tokenizer()
            self.tok.chat_template = template
        self.facade = ChatFacade({"solver": PolicyHandle(self.engine, self.tok, SamplingParams(max_new_tokens=200), name="solver")})

    def say(self, *texts: str) -> None:
        self.replies.extend(texts)

    def client(self, token: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.facade.base_url(token), api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def model():
    m = Model()
    yield m
    m.facade.close()


def test_tools_are_rendered_and_a_call_comes_back_as_tool_calls(model: Model):
    token = model.facade.open_sample("solver")
    model.say("Let me add. " + call("add", a=2, b=3))
    out = model.client(token).chat.completions.create(model="m", messages=USER, tools=[ADD])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 2, "b": 3}
    assert tc.id.startswith("call_")
    (rec,) = model.facade.close_sample(token)
    prompt = TOK.decode(rec.prompt_ids)
    assert prompt.startswith("<|tools|>\nadd(a: integer, b: integer) — Add two integers.\n<|user|>\nWhat is 2+3?")
    assert rec.tools and rec.tool_calls == 1 and not rec.tool_parse_failed


def test_parallel_calls_are_all_returned_unless_parallel_tool_calls_is_false(model: Model):
    c = model.client(model.facade.open_sample("solver"))
    model.say(call("add", a=1, b=2) + call("neg", x=4), call("add", a=1, b=2) + call("neg", x=4))
    both = c.chat.completions.create(model="m", messages=USER, tools=[ADD, NEG]).choices[0].message.tool_calls
    assert [t.function.name for t in both] == ["add", "neg"] and both[0].id != both[1].id
    one = c.chat.completions.create(model="m", messages=USER, tools=[ADD, NEG], parallel_tool_calls=False).choices[0]
    assert [t.function.name for t in one.message.tool_calls] == ["add"]  # generation stopped at the first </tool_call>
    assert model.engine.sampled[-1].finish_reason == "stop" and TOK.decode(model.engine.sampled[-1].token_ids).endswith("</tool_call>")


def test_tool_choice_none_stops_where_a_call_would_begin(model: Model):
    token = model.facade.open_sample("solver")
    model.say("It is 5. " + call("add", a=2, b=3))
    out = model.client(token).chat.completions.create(model="m", messages=USER, tools=[ADD], tool_choice="none").choices[0]
    assert out.message.content == "It is 5. " and out.message.tool_calls is None and out.finish_reason == "stop"
    (rec,) = model.facade.close_sample(token)
    assert TOK.decode(rec.completion_ids) == "It is 5. <tool_call>"  # what was sampled, the stop included


def test_required_and_named_tool_choice_write_the_start_of_the_call_for_the_model(model: Model):
    token = model.facade.open_sample("solver")
    c = model.client(token)
    model.say('neg", "arguments": {"x": 7}}</tool_call>', '{"a": 4, "b": 5}}</tool_call>')
    required = c.chat.completions.create(model="m", messages=USER, tools=[ADD, NEG], tool_choice="required").choices[0]
    assert required.message.tool_calls[0].function.name == "neg"
    named = c.chat.completions.create(model="m", messages=USER, tools=[ADD, NEG],
                                      tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
    (tc,) = named.message.tool_calls
    assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 4, "b": 5}
    first, second = model.facade.close_sample(token)
    assert TOK.decode(first.prompt_ids).endswith('<|assistant|>\n<tool_call>{"name": "')  # prompt: never trained
    assert TOK.decode(second.prompt_ids).endswith('<tool_call>{"name": "add", "arguments": ')
    assert TOK.decode(second.completion_ids) == '{"a": 4, "b": 5}}</tool_call></s>'


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',  # not JSON
    call("multiply", a=1, b=2),  # a function the call did not declare
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}',  # never closed
])
def test_a_call_that_does_not_parse_comes_back_as_content_and_is_counted(model: Model, text: str):
    token = model.facade.open_sample("solver")
    model.say(text)
    out = model.client(token).chat.completions.create(model="m", messages=USER, tools=[ADD]).choices[0]
    assert out.message.content == text and out.message.tool_calls is None and out.finish_reason == "stop"
    (rec,) = model.facade.close_sample(token)
    assert rec.tool_parse_failed and TOK.decode(rec.completion_ids, skip_special_tokens=True) == text


def test_tool_call_deltas_stream_as_openai_clients_assemble_them(model: Model):
    c = model.client(model.facade.open_sample("solver"))
    model.say("ok" + call("add", a=1, b=2) + call("neg", x=3))
    content, calls, finish = "", {}, None
    for chunk in c.chat.completions.create(model="m", messages=USER, tools=[ADD, NEG], stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                slot["name"] += (d.function.name or "") if d.function else ""
                slot["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    assert content == "ok" and finish == "tool_calls"
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == [("add", {"a": 1, "b": 2}), ("neg", {"x": 3})]
    assert all(v["id"].startswith("call_") for v in calls.values())


@pytest.mark.parametrize("kwargs, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0]"),
    ({"tools": [ADD, ADD]}, "tools"),
    ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [*USER, {"role": "tool", "content": "5"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
])
def test_malformed_tool_requests_are_refused_naming_the_field(model: Model, kwargs: dict, param: str):
    with pytest.raises(openai.BadRequestError) as bad:
        model.client(model.facade.open_sample("solver")).chat.completions.create(model="m", **{"messages": USER, **kwargs})
    assert bad.value.body["param"] == param


def test_a_tool_loop_trains_the_sampled_tokens_and_masks_the_tool_results(model: Model):
    token = model.facade.open_sample("solver")
    c = model.client(token)
    model.say(call("add", a=2, b=3), "5")
    messages: list[Any] = [*USER]
    first = c.chat.completions.create(model="m", messages=messages, tools=[ADD]).choices[0].message
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "5"}]
    assert c.chat.completions.create(model="m", messages=messages, tools=[ADD]).choices[0].message.content == "5"
    t = trajectory(model, token)
    ids, mask = t.completion().tolist(), t.mask().tolist()
    assert t.meta["unchained_calls"] == 0 and t.meta["tool_calls"] == 1 and t.meta["tool_call_parse_failures"] == 0
    assert [i for i, m in zip(ids, mask) if m] == [i for s in model.engine.sampled for i in s.token_ids]
    assert TOK.decode([i for i, m in zip(ids, mask) if not m]) == "\n<|tool|>\n5\n<|assistant|>\n"


def trajectory(model: Model, token: str):
    task = Task(task_id="t", workflow="openai_agent", policy="solver", prompt_id="p", prompt="x", group_size=1, meta={"answer": "5"})
    handle = model.facade.handles["solver"]
    return sample_trajectory(task, "solver", 0, model.facade.close_sample(token), Outcome(answer="5"), get_reward("arithmetic"),
                             handle, "n0")


# ---------------------------------------------------------------- token fidelity, for any session
words = st.text(alphabet="abcxyz 0123456789.,", min_size=0, max_size=12)
calls = st.lists(st.tuples(st.sampled_from(["add", "neg"]), st.integers(-99, 999)), min_size=1, max_size=3)
turn = st.fixed_dictionaries({
    "lead": words,
    "calls": st.one_of(st.none(), calls),  # None: a plain answer
    "n": st.integers(1, 3),
    "pick": st.integers(0, 2),  # which choice the client goes on with
    "stream": st.booleans(),
    "stop": st.booleans(),  # the request has a stop string the model writes
    "parallel": st.booleans(),
})


def written(t: dict[str, Any], k: int) -> str:
    body = "".join(call(name, x=v) if name == "neg" else call(name, a=v, b=k) for name, v in t["calls"] or [])
    return f"{t['lead']}{k}" + (" STOP tail" if t["stop"] and not t["calls"] else "") + body


def ask(c: openai.OpenAI, messages: list[Any], t: dict[str, Any]) -> dict[str, Any]:
    """One call; the assistant message of the chosen choice, as a client would send it back."""
    kw: dict[str, Any] = {"tools": [ADD, NEG], "n": t["n"], **({"stop": ["STOP"]} if t["stop"] else {}),
                          **({} if t["parallel"] else {"parallel_tool_calls": False})}
    pick = min(t["pick"], t["n"] - 1)
    if not t["stream"]:
        return c.chat.completions.create(model="m", messages=messages, **kw).choices[pick].message.model_dump(exclude_none=True)
    content, tool_calls = "", {}
    for chunk in c.chat.completions.create(model="m", messages=messages, stream=True, **kw):
        for ch in (x for x in chunk.choices if x.index == pick):
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                slot = tool_calls.setdefault(d.index, {"id": d.id, "type": "function", "function": {"name": "", "arguments": ""}})
                slot["function"]["name"] += d.function.name or ""
                slot["function"]["arguments"] += d.function.arguments or ""
    msg: dict[str, Any] = {"role": "assistant", "content": content or None}
    return {**msg, "tool_calls": [tool_calls[k] for k in sorted(tool_calls)]} if tool_calls else msg


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(session=st.lists(turn, min_size=1, max_size=4))
def test_the_trained_tokens_are_the_sampled_tokens_for_any_session(model: Model, session: list[dict[str, Any]]):
    token = model.facade.open_sample("solver")
    c = model.client(token)
    messages: list[Any] = [{"role": "system", "content": "calc"}, *USER]
    chosen: list[Completion] = []
    for k, t in enumerate(session):
        t = {**t, "n": 1} if k == len(session) - 1 else t  # the last call: one choice, so the trajectory ends on it
        model.engine.load_state({}, k)  # weights move between calls
        model.engine.logprob = -0.1 * (k + 1)
        model.say(*(written(t, k) for _ in range(t["n"])))
        before = len(model.engine.sampled)
        reply = ask(c, messages, t)
        chosen.append(model.engine.sampled[before + min(t["pick"], t["n"] - 1)])
        messages.append(reply)
        messages += [{"role": "tool", "tool_call_id": tc["id"], "content": f"r{k}"} for tc in reply.get("tool_calls", [])]
        if not reply.get("tool_calls"):
            messages.append({"role": "user", "content": "and?"})
    traj = trajectory(model, token)
    mask = traj.mask().tolist()
    trained = [i for i, m in zip(traj.completion().tolist(), mask) if m]
    assert traj.meta["unchained_calls"] == sum(min(3, t["n"]) - 1 for t in session[:-1])
    assert trained == [i for s in chosen for i in s.token_ids]
    assert [lp for lp, m in zip(traj.behaviour_logprobs().tolist(), mask) if m] == pytest.approx([lp for s in chosen for lp in s.logprobs])
    assert [v for v, m in zip(traj.token_versions().tolist(), mask) if m] == [v for s in chosen for v in s.versions]
    assert all(lp == 0.0 for lp, m in zip(traj.behaviour_logprobs().tolist(), mask) if not m)


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
          "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}</s>{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_models_own_template_chains_its_turns_without_doubling_the_end_token():
    """A pretrained model's template ends each turn with the end-of-turn token the model itself sampled: the turn's exact
    ids already hold it, so the template's copy is not inserted again, and the trajectory chains."""
    m = Model(CHATML)
    m.say(call("add", a=2, b=3), "5")
    try:
        token = m.facade.open_sample("solver")
        c = m.client(token)
        first = c.chat.completions.create(model="m", messages=USER, tools=[ADD]).choices[0].message
        messages = [*USER, first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "5"}]
        c.chat.completions.create(model="m", messages=messages, tools=[ADD])
        one, two = m.facade.close_sample(token)
    finally:
        m.facade.close()
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.completion_ids)] == one.prompt_ids + one.completion_ids
    between = m.tok.decode(two.prompt_ids[len(one.prompt_ids) + len(one.completion_ids) :])
    assert between == "<|im_start|>tool\n5</s><|im_start|>assistant\n"  # one </s> ends the turn: the sampled one


def test_messages_the_models_template_refuses_are_a_400_not_a_server_error():
    m = Model("{{ raise_exception('Conversation roles must alternate user/assistant') }}")
    m.say("x")
    try:
        with pytest.raises(openai.BadRequestError) as bad:
            m.client(m.facade.open_sample("solver")).chat.completions.create(model="m", messages=USER)
    finally:
        m.facade.close()
    assert bad.value.body["param"] == "messages" and "roles must alternate" in bad.value.body["message"]
