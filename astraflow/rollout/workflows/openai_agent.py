"""``openai_agent``: an OpenAI-compatible chat-completions endpoint served by a rollout node, recording
every call, and the workflow that runs unchanged agent code against it.

Existing agent code talks to ``{base_url}/chat/completions`` as it would to any OpenAI-style
server; the facade generates with the node's engine and records, per session, the prompt
token ids, completion token ids, behaviour logprobs and weight versions of every call. The
workflow gives each sample its own session (``base_url`` =
``http://127.0.0.1:PORT/s/{session}/v1``), runs the agent, and turns the recorded calls into
one trajectory: calls whose prompt extends the previous call's prompt + completion are
chained, the tokens in between (user turns, tool results) masked out of the loss.

What the facade honours and what it does not:

- ``messages``, ``max_tokens`` / ``max_completion_tokens`` (capped at ``rollout.max_new_tokens``),
  ``stop``, ``n``, ``seed``, ``logprobs``: honoured;
- ``temperature``, ``top_p``: ignored — tokens are sampled from the recipe's sampling
  distribution, the one the trainer's importance ratios assume; the response's
  ``system_fingerprint`` names the version that produced it.

Prompts: the tokenizer's chat template when it has one; otherwise a token-level template
(``<|role|>\\n`` + content + ``\\n``) in which an assistant message whose text is a completion
this session produced is re-inserted as that completion's exact token ids, so multi-call
agents chain into one trajectory.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from http.server import ThreadingHTTPServer
from importlib import import_module
from typing import Any, Callable, Mapping

from astraflow.rollout.engines.base import Completion, GenerationRequest
from astraflow.rollout.http_json import JsonHandler
from astraflow.rollout.rewards import Reward
from astraflow.rollout.workflows.base import Episode, Evaluation, PolicyHandle, by_policy, min_version
from astraflow.rollout.workflows.options import OpenAIAgentOptions
from astraflow.rollout.workflows.registry import register_workflow
from astraflow.streams.messages import Task, Trajectory


@dataclass(frozen=True)
class CallRecord:
    """One chat-completions call: what the model saw and produced (arrays aligned with ``completion_ids``)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str


@dataclass
class Session:
    min_version: int = 0
    calls: list[CallRecord] = field(default_factory=list)
    produced: dict[str, list[int]] = field(default_factory=dict)  # completion text -> its token ids


class ChatFacade:
    """A local OpenAI-style server over one policy handle (``http.server`` on a daemon thread)."""

    def __init__(self, handle: PolicyHandle, model: str = "policy", host: str = "127.0.0.1", port: int = 0) -> None:
        self.handle = handle
        self.model = model
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, port), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="openai-facade", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def base_url(self, session: str) -> str:
        return f"{self.url}/s/{session}/v1"

    def open(self, session: str, min_version: int = 0) -> str:
        with self.lock:
            self.sessions[session] = Session(min_version)
        return self.base_url(session)

    def pop(self, session: str) -> list[CallRecord]:
        with self.lock:
            s = self.sessions.pop(session, None)
        return s.calls if s else []

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------ one call
    def _session(self, name: str) -> Session:
        with self.lock:
            return self.sessions.setdefault(name, Session())

    def render(self, messages: list[dict[str, Any]], session: Session) -> list[int]:
        h = self.handle
        if getattr(h.tokenizer, "chat_template", None):
            out = h.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if isinstance(out, Mapping) else out)
        ids: list[int] = []
        for m in messages:
            content = _text(m.get("content"))
            body = session.produced.get(content) if m.get("role") == "assistant" else None
            ids += h.encode(f"<|{m.get('role', 'user')}|>\n") + (body if body is not None else h.encode(content)) + h.encode("\n")
        return ids + h.encode("<|assistant|>\n")

    def complete(self, body: dict[str, Any], session_name: str) -> dict[str, Any]:
        session = self._session(session_name)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        h = self.handle
        prompt = self.render(messages, session)
        budget = body.get("max_completion_tokens") or body.get("max_tokens") or h.params.max_new_tokens
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        params = replace(h.params, max_new_tokens=max(1, min(int(budget), h.params.max_new_tokens)),
                         stop=tuple(dict.fromkeys((*h.params.stop, *stop))),
                         seed=body.get("seed", h.params.seed))
        n = int(body.get("n") or 1)
        comps: list[Completion] = h.generate([GenerationRequest(prompt, params) for _ in range(n)], session.min_version)
        choices = []
        for k, c in enumerate(comps):
            text = h.decode(c.token_ids)
            rec = CallRecord(prompt, c.token_ids, c.logprobs, c.versions, c.finish_reason, text)
            with self.lock:
                session.calls.append(rec)
                session.produced[text] = list(c.token_ids)
            choice: dict[str, Any] = {"index": k, "message": {"role": "assistant", "content": text},
                                      "finish_reason": c.finish_reason}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [{"token": h.tokenizer.decode([t]), "logprob": lp, "top_logprobs": []}
                                                  for t, lp in zip(c.token_ids, c.logprobs)]}
            choices.append(choice)
        version = max((v for c in comps for v in c.versions), default=h.engine.version)
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or self.model, "system_fingerprint": f"astraflow-v{version}", "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": sum(len(c.token_ids) for c in comps),
                          "total_tokens": len(prompt) * n + sum(len(c.token_ids) for c in comps)}}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _handler(facade: ChatFacade) -> type[JsonHandler]:
    class Handler(JsonHandler):
        def _route(self) -> tuple[str, str]:
            """(session, path below /v1)."""
            path = self.path.split("?", 1)[0]
            session = self.headers.get("X-Astraflow-Session", "default")
            if path.startswith("/s/"):
                _, _, session, path = path.split("/", 3)
                path = "/" + path
            return session, path.removeprefix("/v1")

        def do_GET(self) -> None:  # noqa: N802
            _, path = self._route()
            if path == "/models":
                return self._reply(200, {"object": "list", "data": [{"id": facade.model, "object": "model", "owned_by": "astraflow"}]})
            self._reply(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

        def do_POST(self) -> None:  # noqa: N802
            session, path = self._route()
            if path != "/chat/completions":
                return self._reply(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if body.get("stream"):
                    raise ValueError("stream=true is not supported by the astraflow facade")
                self._reply(200, facade.complete(body, session))
            except (ValueError, TypeError, KeyError) as e:
                self._reply(400, {"error": {"message": str(e), "type": "invalid_request_error"}})
            except Exception as e:  # noqa: BLE001  (a stale-weights refusal, an engine failure)
                self._reply(503, {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})

    return Handler


def calls_to_episode(calls: list[CallRecord]) -> tuple[Episode, int]:
    """One episode from a session's calls: the last call and every earlier call its prompt extends.

    Returns the episode and the number of calls that did not chain (dropped from training).
    """
    if not calls:
        raise ValueError("the agent made no chat-completions call")
    chain = [calls[-1]]
    for c in reversed(calls[:-1]):
        head = chain[0]
        seen = c.prompt_ids + c.completion_ids
        if head.prompt_ids[: len(seen)] == seen:
            chain.insert(0, c)
    ep = Episode(list(chain[0].prompt_ids))
    for k, c in enumerate(chain):
        if k:
            ep.add_inserted(c.prompt_ids[len(ep.context()) :])
        ep.add_generated(Completion(c.completion_ids, c.logprobs, c.versions, c.finish_reason))
    return ep, len(calls) - len(chain)


Agent = Callable[[str, str, dict[str, Any]], str]
"""``agent(base_url, prompt, meta) -> final answer``: unchanged agent code pointed at the facade."""


def load_agent(spec: str) -> Agent:
    """The agent function ``module:function`` names (the options checked its shape at load)."""
    module, _, name = spec.partition(":")
    return getattr(import_module(module), name)


@register_workflow("openai_agent", OpenAIAgentOptions)
class OpenAIAgent:
    """Runs agent code against the node's facade, one session per sample; reward = the recipe's reward of the answer."""

    policies = ("solver",)
    evaluation: Evaluation = "single_turn"  # agent code is not replayed on held-out prompts

    def __init__(self, reward: Reward, options: OpenAIAgentOptions) -> None:
        self.reward = reward
        self.agent = load_agent(options.agent)
        self.concurrency = options.concurrency
        self.facades: dict[str, ChatFacade] = {}

    def facade(self, policy: str, handle: PolicyHandle) -> ChatFacade:
        if policy not in self.facades:
            self.facades[policy] = ChatFacade(handle, model=policy)
        return self.facades[policy]

    def close(self) -> None:
        for f in self.facades.values():
            f.close()

    def run(self, tasks: list[Task], policies: Mapping[str, PolicyHandle], node_id: str) -> list[Trajectory]:
        out: list[Trajectory] = []
        for policy, group in by_policy(tasks).items():
            facade = self.facade(policy, policies[policy])
            jobs = [(t, i, f"{t.task_id}.{i}.{uuid.uuid4().hex[:6]}") for t in group for i in range(t.group_size)]

            def play(job: tuple[Task, int, str]) -> tuple[str, str | None]:
                t, i, sid = job
                url = facade.open(sid, min_version(t, policy))
                try:
                    return str(self.agent(url, t.prompt, dict(t.meta))), None
                except Exception as e:  # the agent failed on what the model said: a scored episode, reward 0
                    return "", f"{type(e).__name__}: {e}"

            with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
                results = list(pool.map(play, jobs))
            for (t, i, sid), (answer, error) in zip(jobs, results):
                ep, dropped = calls_to_episode(facade.pop(sid))
                reward = 0.0 if error else self.reward(answer, t.meta)
                meta: dict[str, Any] = {"calls": ep.turns + dropped, "unchained_calls": dropped}
                if error:
                    meta["agent_error"] = error[:300]
                    ep.finish_reason = "error"
                out.append(ep.trajectory(t, policy, i, t.group_size, reward, node_id, meta))
        return out
