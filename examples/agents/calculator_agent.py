"""A tool-calling agent written with the OpenAI Agents SDK (``openai-agents``), as anyone would write it.

Nothing in it knows about training: it talks to an OpenAI-compatible ``base_url`` and calls its tools
through the API's ``tools`` / ``tool_calls`` (it borrows astraflow's safe arithmetic evaluator for one tool;
any would do). The recipe ``recipes/calculator-agent`` trains it
unchanged: its workflow is ``{type: openai_agent, agent: ../../examples/agents/calculator_agent.py:solve}``,
so each sample's ``solve`` runs against a rollout node's facade, whose recorded tokens are what is trained.

Two tools: ``evaluate(expression)``, exact, and ``estimate(expression)``, to the nearest thousand. A problem
"Compute 347*829+512." is solved by evaluating the expression and answering with the result; an estimate is wrong.

Run it against any OpenAI-compatible server: ``python examples/agents/calculator_agent.py URL "Compute 3*4+5."``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from astraflow.rollout.workflows.tools import calculator

set_tracing_disabled(True)  # no traces leave the machine
INSTRUCTIONS = "Answer with the number."


@function_tool
def evaluate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly."""
    return calculator(expression, {})


@function_tool
def estimate(expression: str) -> str:
    """Estimate an arithmetic expression to the nearest thousand."""
    return str(int(round(float(calculator(expression, {})), -3)))


async def episode(base_url: str, prompt: str) -> str:
    """The agent's final answer to ``prompt`` (at most three model calls)."""
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[evaluate, estimate],
                      model=OpenAIChatCompletionsModel(model="solver", openai_client=client))
        result = await Runner.run(agent, prompt, max_turns=3)
        return str(result.final_output)


def solve(base_url: str, prompt: str, meta: dict[str, Any]) -> str:
    """One episode, as the ``openai_agent`` workflow calls it: ``solve(base_url, prompt, meta) -> answer``."""
    return asyncio.run(episode(base_url, prompt))


if __name__ == "__main__":
    print(solve(sys.argv[1], sys.argv[2], {}))
