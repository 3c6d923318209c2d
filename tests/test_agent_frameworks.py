"""Agent frameworks run unchanged against the facade, tool calls and streaming included, and what they sample is trained.

The OpenAI Agents SDK (``openai-agents``) and LangGraph with ``langchain-openai`` each run their own ReAct loop:
they send ``tools``, read ``tool_calls``, run the tool and send its result back as a ``tool`` message. The model
is a script engine writing what a trained model would; the trajectory built from the recorded calls must chain
into one episode whose trained tokens are exactly the sampled ones, with the tool result masked.
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from test_facade_tools import Model, call, trajectory

set_tracing_disabled(True)


@pytest.fixture
def model():
    m = Model()
    yield m
    m.facade.close()


def trained(model: Model, token: str, answer: str = "5") -> tuple[Any, str]:
    """The sample's trajectory, after checking that it is the sampled tokens with everything between them masked."""
    t = trajectory(model, token)
    ids, mask = t.completion().tolist(), t.mask().tolist()
    assert t.meta["unchained_calls"] == 0 and t.meta["tool_call_parse_failures"] == 0
    assert [i for i, m in zip(ids, mask) if m] == [i for s in model.engine.sampled for i in s.token_ids]
    return t, model.engine.tokenizer.decode([i for i, m in zip(ids, mask) if not m])


@function_tool
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


def sdk_agent(model: Model, token: str) -> tuple[Agent, AsyncOpenAI]:
    client = AsyncOpenAI(base_url=model.facade.base_url(token), api_key="unused", max_retries=0)
    model_ = OpenAIChatCompletionsModel(model="solver", openai_client=client)
    agent = Agent(name="adder", instructions="Use add.", tools=[add], model=model_)
    return agent, client


@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_sdk_calls_its_tool_through_the_facade(model: Model, streamed: bool):
    token = model.facade.open_sample("solver")
    model.say(call("add", a=2, b=3), "5")

    async def run() -> str:
        agent, client = sdk_agent(model, token)
        async with client:
            if not streamed:
                return str((await Runner.run(agent, "What is 2+3?", max_turns=3)).final_output)
            result = Runner.run_streamed(agent, "What is 2+3?", max_turns=3)
            async for _ in result.stream_events():
                pass
            return str(result.final_output)

    assert asyncio.run(run()) == "5"
    t, masked = trained(model, token)
    assert t.meta["calls"] == 2 and t.meta["tool_calls"] == 1
    assert masked == "\n<|tool|>\n5\n<|assistant|>\n"  # the tool's result, as the SDK sent it back
    prompt = model.engine.tokenizer.decode(t.prompt_tokens().tolist())
    assert prompt.startswith("<|tools|>\nadd(a: integer, b: integer) — Add two integers.")


@tool
def multiply(a: int, b: int) -> str:
    """Multiply two integers."""
    return str(a * b)


@pytest.mark.parametrize("streaming", [False, True])
def test_langgraph_react_agent_calls_its_tool_through_the_facade(model: Model, streaming: bool):
    from langgraph.prebuilt import create_react_agent

    token = model.facade.open_sample("solver")
    model.say(call("multiply", a=6, b=7), "42")
    llm = ChatOpenAI(model="solver", base_url=model.facade.base_url(token), api_key="unused", max_retries=0, streaming=streaming)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LangGraph 1.0 moved create_react_agent to langchain.agents; it is still served
        graph = create_react_agent(llm, [multiply], prompt="Use multiply.")
    out = graph.invoke({"messages": [("user", "What is 6*7?")]})
    assert out["messages"][-1].content == "42"
    t, masked = trained(model, token, "42")
    assert t.meta["calls"] == 2 and masked == "\n<|tool|>\n42\n<|assistant|>\n"


def test_the_example_agent_solves_with_the_right_tool(model: Model):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "agents"))
    from calculator_agent import solve

    token = model.facade.open_sample("solver")
    model.say(call("evaluate", expression="347*829+512"), "288175")
    assert solve(model.facade.base_url(token), "Compute \"347*829+512\".\n", {}) == "288175"
    _, masked = trained(model, token)
    assert masked == f"\n<|tool|>\n{347 * 829 + 512}\n<|assistant|>\n"
