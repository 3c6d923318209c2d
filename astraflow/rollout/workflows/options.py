"""Options of the built-in workflows: what the recipe's ``workflow:`` may hold, one model per workflow.

Light on purpose (pydantic only): every role validates a recipe against these
(``astraflow.registry.WORKFLOWS`` imports this module). A field another workflow owns fails
at load (``max_turns`` on ``single_turn``).

    workflow: single_turn
    workflow: {type: multi_turn_tools, max_turns: 3, tools: [bm25]}
    workflow: {type: env_http, url: bundled, env: rooms, max_turns: 4}
    workflow: {type: openai_agent, agent: "my_agents:solve", concurrency: 4}
    workflow: {type: openai_agent, agent: external, host: 0.0.0.0, port: 8400}
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from astraflow.registry import WORKFLOWS, Claims, Options

ANSWERED = Claims(prompt="issued", reward="rescored")  # the issued prompt, scored by the recipe's reward from the completion
UNIT = (0.0, 1.0)


@WORKFLOWS.declare
class SingleTurnOptions(Options):
    """RLVR: one generation per sample (``single_turn.py``)."""

    type: Literal["single_turn"] = "single_turn"
    claims: ClassVar[tuple[Claims, ...]] = (ANSWERED,)


@WORKFLOWS.declare
class MultiTurnToolsOptions(Options):
    """The model calls tools between turns (``tools.py``)."""

    type: Literal["multi_turn_tools"] = "multi_turn_tools"
    claims: ClassVar[tuple[Claims, ...]] = (Claims(prompt="issued", reward="bounded"),)  # the reward scores the last answer
    max_turns: int = Field(4, ge=1)
    """Generation turns per episode."""
    tools: list[str] = ["calculator", "search"]
    """Tools the model may call, by registered name (``calculator``, ``search``, ``bm25``, a plug-in's)."""


@WORKFLOWS.declare
class EnvHttpOptions(Options):
    """Episodes against an environment server with POST /start, /step, /close (``env.py``)."""

    type: Literal["env_http"] = "env_http"
    claims: ClassVar[tuple[Claims, ...]] = ()  # the environment writes the prompt and is the verifier
    url: str
    """Base URL of the environment server, or ``bundled``: the text games of ``astraflow.rollout.envs`` served
    on a loopback port inside each node."""
    env: str = "rooms"
    """Environment name sent to /start (the bundled server has ``rooms`` and ``shop``)."""
    max_turns: int = Field(4, ge=1)
    """Environment steps per episode."""


@WORKFLOWS.declare
class SolverVerifierOptions(Options):
    """Two policies: a solver and a verifier that judges each answer (``multi_policy.py``)."""

    type: Literal["solver_verifier"] = "solver_verifier"
    claims: ClassVar[tuple[Claims, ...]] = (ANSWERED, Claims(reward="bounded", reward_range=UNIT))  # a verdict is right (1) or wrong (0)


@WORKFLOWS.declare
class SolverSelectorOptions(Options):
    """Two policies: a solver and a selector that picks the best of its answers (``multi_policy.py``)."""

    type: Literal["solver_selector"] = "solver_selector"
    claims: ClassVar[tuple[Claims, ...]] = (ANSWERED, Claims(reward="bounded"))  # the selector earns the reward of the answer it picks


@WORKFLOWS.declare
class SolverTestgenOptions(Options):
    """Two policies: a code solver and a test-case generator (``multi_policy.py``)."""

    type: Literal["solver_testgen"] = "solver_testgen"
    claims: ClassVar[tuple[Claims, ...]] = (Claims(prompt="issued", reward="bounded", reward_range=UNIT),  # pass fraction
                                            Claims(reward="bounded", reward_range=UNIT))


@WORKFLOWS.declare
class OpenAIAgentOptions(Options):
    """Agent code against the node's OpenAI-compatible endpoint (``openai_agent.py``)."""

    type: Literal["openai_agent"] = "openai_agent"
    claims: ClassVar[tuple[Claims, ...]] = (Claims(reward="bounded"),)  # the agent writes the chat; its answer is scored by the reward
    agent: str
    """``module:function`` of a Python agent, called in the node as ``agent(base_url, prompt, meta) -> answer`` (imported
    by the nodes that play it, not at load); or ``external``: agents of any runtime pull the tasks and open a session per
    task on the endpoint (docs/rollout.md, "Agents in any language")."""
    concurrency: int = Field(4, ge=1)
    """Python agent episodes a node runs at once."""
    host: str = "127.0.0.1"
    """Address the endpoint listens on (``0.0.0.0``: every interface, for agents on other machines)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the endpoint; 0: a free port per node. The address is logged and advertised in the node's heartbeat."""
    advertise_host: str | None = None
    """Host name agents reach the node by (default: ``host``, or the machine's name when listening on every interface)."""
    session_timeout: float = Field(900.0, gt=0)
    """Seconds an external agent's session may stay open before the node drops it (the task is redelivered)."""

    @field_validator("agent")
    @classmethod
    def _spec(cls, spec: str) -> str:
        module, sep, name = spec.partition(":")
        if spec != "external" and not (module and sep and name):
            raise ValueError(f"agent {spec!r} must look like module:function, or be external")
        return spec
