"""Agent sessions: a sample's recorded calls become its trajectory, and agents of any runtime open a session per task.

The session protocol (``docs/rollout.md``, "Agents in any language"), served by a node whose
workflow is ``openai_agent`` with ``agent: external``. The agent pulls tasks from the plane
itself and, per task:

1. ``POST /v1/sessions`` ``{"task": <the task's fields>, "agent": "<its name>"}`` -> ``{"session",
   "samples": [{"index", "base_url"}], "version", "expires_in"}``: one OpenAI base URL per sample.
   409 (``stale_weights``): the node's weights are older than the task allows, nak it; 400: the
   task is invalid, dead-letter it; 503: the node is leaving, nak it.
2. the agent plays each sample against its ``base_url`` (``/chat/completions``, ``/completions``);
   the node records every call's token ids, behaviour logprobs and versions.
3. ``POST /v1/sessions/{session}/finish`` ``{"samples": [{"index", "reward" | "answer" | "error",
   "meta"?}]}`` -> ``{"published": [traj_id, ...], "rewards": [...]}`` once the trajectories are
   stored; then the agent acks the task. A sample with an ``error``, or missing from the list, or
   that made no model call, is a scored failure: reward 0, ``finish_reason`` ``error``. An
   ``answer`` is scored with the recipe's reward; a ``reward`` is taken as is.
4. ``DELETE /v1/sessions/{session}`` gives the session up (the agent naks the task). A session
   not finished within ``session_timeout`` is dropped the same way.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from astraflow.rollout.engines.base import Completion
from astraflow.rollout.rewards import Reward
from astraflow.rollout.workflows.base import Episode, PolicyHandle
from astraflow.rollout.workflows.openai_errors import BadRequest, NotFound, StaleNode, Unavailable
from astraflow.rollout.workflows.openai_facade import CallRecord, ChatFacade
from astraflow.streams.messages import Task, Trajectory


@dataclass(frozen=True)
class NodeServices:
    """What a node lends a workflow that serves agents."""

    node_id: str
    handles: Mapping[str, PolicyHandle]
    publish: Callable[[list[Trajectory]], None]  # blocking: returns once the trajectories are stored
    draining: Callable[[], bool]  # the node is leaving: open no new session
    api_key: str | None = None  # the bearer token the endpoint asks for (None: none)


@runtime_checkable
class AgentHost(Protocol):
    """A workflow that serves an OpenAI-compatible endpoint from the node (``openai_agent``)."""

    external: bool  # agents pull the tasks themselves: the node pulls none and serves sessions

    def start(self, node: NodeServices) -> str:
        """Start serving; returns the endpoint's address (advertised in the node's heartbeat)."""

    def counters(self) -> dict[str, float]:
        """Cumulative figures for the heartbeat (``gen_s``, sessions opened / finished / expired, agent errors)."""

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for open sessions to finish (a draining node); True when none is left."""


@dataclass(frozen=True)
class Outcome:
    """How one sample ended, as its agent reports it."""

    reward: float | None = None  # the agent's own score
    answer: str | None = None  # scored with the recipe's reward when no reward is given
    error: str | None = None  # the agent failed: a scored failure
    meta: dict[str, Any] = field(default_factory=dict)


def calls_to_episode(calls: list[CallRecord]) -> tuple[Episode, int]:
    """One episode from a sample's calls: the last call and every earlier call its prompt extends.

    Returns the episode and the number of calls that did not chain (dropped from training). Tokens
    between chained calls (user turns, tool results) are inserted, masked; a call sampled away from
    the recipe's distribution (another temperature or top_p) is kept as context but masked too."""
    chain = [calls[-1]]
    for c in reversed(calls[:-1]):
        seen = c.prompt_ids + c.completion_ids
        if chain[0].prompt_ids[: len(seen)] == seen:
            chain.insert(0, c)
    ep = Episode(list(chain[0].prompt_ids))
    for k, c in enumerate(chain):
        if k:
            ep.add_inserted(c.prompt_ids[len(ep.context()) :])
        ep.add_generated(Completion(c.completion_ids, c.logprobs, c.versions, c.finish_reason))
        if not c.on_policy:
            ep.mask[len(ep.mask) - len(c.completion_ids) :] = [0] * len(c.completion_ids)
    return ep, len(calls) - len(chain)


def sample_trajectory(task: Task, policy: str, index: int, calls: list[CallRecord], outcome: Outcome, reward: Reward,
                      handle: PolicyHandle, node_id: str) -> Trajectory:
    """The trajectory of one sample: its chained calls, scored by the outcome (an error, or no call at all: reward 0)."""
    error = outcome.error if outcome.error is not None or calls else "the agent made no model call"
    if calls:
        ep, dropped = calls_to_episode(calls)
    else:
        ep, dropped = Episode(handle.encode(task.prompt)), 0
    meta: dict[str, Any] = {**outcome.meta, "calls": len(calls), "unchained_calls": dropped}
    if any(c.tools for c in calls):
        meta["tool_calls"] = sum(c.tool_calls for c in calls)
        meta["tool_call_parse_failures"] = sum(c.tool_parse_failed for c in calls)
    off_policy = sum(len(c.completion_ids) for c in calls if not c.on_policy)
    if off_policy:
        meta["off_policy_tokens"] = off_policy
    if error is not None:
        meta["agent_error"] = error[:300]
        ep.finish_reason = "error"
        score = 0.0
    else:
        score = outcome.reward if outcome.reward is not None else reward(outcome.answer or "", task.meta)
    return ep.trajectory(task, policy, index, task.group_size, score, node_id, meta)


class SampleResult(BaseModel):
    """One sample's report in a finish request."""

    model_config = ConfigDict(extra="forbid", strict=True)
    index: int = Field(ge=0)
    reward: float | None = Field(None, allow_inf_nan=False)
    answer: str | None = None
    error: str | None = None
    meta: dict[str, Any] = {}


class FinishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    samples: list[SampleResult]


@dataclass
class TaskSession:
    task: Task
    tokens: list[str]  # one facade sample per group member, in index order
    agent: str
    opened: float = field(default_factory=time.monotonic)
    finishing: bool = False  # its outcome is being published


class TaskSessions:
    """The session endpoints of a node that serves external agents (see the module docstring)."""

    def __init__(self, facade: ChatFacade, reward: Reward, node: NodeServices, timeout_s: float) -> None:
        self.facade, self.reward, self.node, self.timeout_s = facade, reward, node, timeout_s
        self.open_sessions: dict[str, TaskSession] = {}
        self.lock = threading.Lock()
        self.closed = threading.Condition(self.lock)  # notified whenever a session ends
        self.stats = dict.fromkeys(("sessions_opened", "sessions_finished", "sessions_abandoned", "sessions_expired",
                                    "stale_refusals", "agent_errors"), 0.0)

    def open(self, body: Any) -> dict[str, Any]:
        if self.node.draining():
            raise Unavailable("the node is leaving: give the task back (nak)")
        self.expire()
        if not isinstance(body, dict) or not isinstance(body.get("task"), dict) or not isinstance(body.get("agent", ""), str):
            raise BadRequest('the body is {"task": {...the task\'s fields...}, "agent": "name"}')
        try:
            task = Task.model_validate(body["task"], strict=True)
        except ValidationError as e:
            raise BadRequest(f"invalid task (dead-letter it): {e.errors(include_url=False)}", "task") from None
        handles = self.facade.handles
        if task.policy not in handles:
            raise BadRequest(f"task {task.task_id} is for policy {task.policy!r}; this node serves {sorted(handles)}", "task.policy")
        stale = {p: v for p, v in task.min_versions.items() if p in handles and handles[p].engine.version < v}
        if stale:
            handles[task.policy].safe_point()  # weights may have arrived since the last refresh
            stale = {p: v for p, v in stale.items() if handles[p].engine.version < v}
        if stale:
            self._count("stale_refusals", 1)
            p, need = next(iter(stale.items()))
            raise StaleNode(f"{p} is at v{handles[p].engine.version} here; task {task.task_id} needs v{need}: nak it",
                            holds=handles[p].engine.version, needs=need)
        need = int(task.min_versions.get(task.policy, 0))
        tokens = [self.facade.open_sample(task.policy, need) for _ in range(task.group_size)]
        sid = f"sess-{secrets.token_urlsafe(12)}"
        with self.lock:
            self.open_sessions[sid] = TaskSession(task, tokens, body.get("agent", ""))
        self._count("sessions_opened", 1)
        return {"session": sid, "task_id": task.task_id, "policy": task.policy, "version": handles[task.policy].engine.version,
                "expires_in": self.timeout_s,
                "samples": [{"index": i, "base_url": self.facade.base_url(t)} for i, t in enumerate(tokens)]}

    def finish(self, session: str, body: Any) -> dict[str, Any]:
        try:
            req = FinishRequest.model_validate(body, strict=True)
        except ValidationError as e:
            raise BadRequest(f'the body is {{"samples": [{{"index", "reward" | "answer" | "error", "meta"}}]}}: '
                             f"{e.errors(include_url=False)}") from None
        with self.lock:
            s = self.open_sessions.get(session)
            if s is None or s.finishing:
                raise NotFound(f"no open session {session} (finished, abandoned or expired): nak the task")
            n = s.task.group_size
            indexes = [r.index for r in req.samples]
            if len(set(indexes)) != len(indexes) or any(i >= n for i in indexes):
                raise BadRequest(f"sample indexes must be distinct and below the group size {n}, got {indexes}", "samples")
            s.finishing = True  # open until published: a draining node waits for it
        try:
            return self._publish(s, req)
        finally:
            with self.lock:
                del self.open_sessions[session]
                self.closed.notify_all()

    def _publish(self, s: TaskSession, req: FinishRequest) -> dict[str, Any]:
        reported = {r.index: Outcome(r.reward, r.answer, r.error, r.meta) for r in req.samples}
        t, handle = s.task, self.facade.handles[s.task.policy]
        trajs = []
        for i, token in enumerate(s.tokens):
            outcome = reported.get(i, Outcome(error="not reported by the agent"))
            traj = sample_trajectory(t, t.policy, i, self.facade.close_sample(token), outcome, self.reward, handle, self.node.node_id)
            trajs.append(traj.model_copy(update={"meta": {**traj.meta, "agent": s.agent}}))
        self._count("agent_errors", sum(tr.finish_reason == "error" for tr in trajs))
        try:
            self.node.publish(trajs)
        except Exception as e:  # the plane refused: nothing is acked, the task comes back
            raise Unavailable(f"publishing the trajectories failed ({type(e).__name__}: {e}): nak the task") from None
        self._count("sessions_finished", 1)
        return {"published": [tr.traj_id for tr in trajs], "rewards": [tr.reward for tr in trajs]}

    def abandon(self, session: str) -> dict[str, Any]:
        with self.lock:
            s = self.open_sessions.get(session)
            if s is None or s.finishing:
                raise NotFound(f"no open session {session}")
            del self.open_sessions[session]
            self.closed.notify_all()
        self._drop(s)
        self._count("sessions_abandoned", 1)
        return {"abandoned": session}

    def expire(self) -> int:
        """Drop sessions open longer than the timeout (their agents are gone; the server redelivers their tasks)."""
        now = time.monotonic()
        with self.lock:
            old = [k for k, s in self.open_sessions.items() if now - s.opened > self.timeout_s and not s.finishing]
            gone = [self.open_sessions.pop(k) for k in old]
            self.closed.notify_all()
        for s in gone:
            self._drop(s)
        self._count("sessions_expired", len(gone))
        return len(gone)

    def _count(self, key: str, n: float) -> None:
        with self.lock:  # endpoint threads count concurrently
            self.stats[key] += n

    def _drop(self, s: TaskSession) -> None:
        for token in s.tokens:
            self.facade.close_sample(token)

    def wait_idle(self, timeout: float) -> bool:
        with self.closed:
            return self.closed.wait_for(lambda: not self.open_sessions, timeout)
