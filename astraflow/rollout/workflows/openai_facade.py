"""An OpenAI-compatible endpoint served by a rollout node from its engines, recording every call per sample.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (whole or ``stream: true`` as
server-sent events) and ``GET /v1/models``, on a stdlib ``ThreadingHTTPServer`` on a daemon
thread. A call under ``/s/{token}/v1/...`` belongs to one sample: the facade records its prompt
token ids, completion token ids, behaviour logprobs and per-token versions, which become that
sample's trajectory. The token is random and is the sample's capability: whoever holds it may
generate in it. Every other route needs ``Authorization: Bearer {api_key}`` when the facade has
a key (a node in a secure run uses its own credential's password).

Concurrent calls on one policy share the engine: calls that queue while it generates go into
its next ``generate`` together. Agent sessions (``/v1/sessions``) are routed to the node's
:class:`~astraflow.rollout.workflows.agent_sessions.TaskSessions` when it hosts external agents.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from http.server import ThreadingHTTPServer
from typing import Any, Protocol

from astraflow.chat_template import CALL_OPEN, CHAT_TEMPLATE
from astraflow.rollout.engines.base import Completion, GenerationRequest, StaleWeights
from astraflow.rollout.http_json import JsonHandler
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.openai_api import ApiCall, Choice, Kind, chunks, parse_call, response, trim_stop, usage
from astraflow.rollout.workflows.openai_errors import ApiError, BadRequest, NotFound, Unauthorized, Unavailable
from astraflow.rollout.workflows.tool_calls import Reading, read_calls
from astraflow.streams.credentials import is_loopback

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallRecord:
    """One choice of one call: what the model saw and produced (arrays aligned with ``completion_ids``)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str  # what the client got (request stop strings trimmed)
    on_policy: bool = True  # sampled from the recipe's distribution; otherwise masked out of the loss
    prompt_text: str | None = None  # a completions call's prompt as text (a later call that extends it chains)
    tools: bool = False  # the call declared tools
    tool_calls: int = 0  # calls read from the text
    tool_parse_failed: bool = False  # the text held a call that did not parse: returned as content


@dataclass
class SampleLog:
    """The calls of one sample, and what the client was shown of each completion (to re-insert its exact ids)."""

    policy: str
    min_version: int = 0
    calls: list[CallRecord] = field(default_factory=list)
    produced: dict[str, list[int]] = field(default_factory=dict)  # text the client got -> the turn's token ids
    produced_calls: dict[str, list[int]] = field(default_factory=dict)  # a tool call's id -> the turn's token ids

    def turn_ids(self, message: dict[str, Any]) -> list[int] | None:
        """The exact token ids of an assistant turn this sample produced (the written prefix and the sample), or None."""
        calls = message.get("tool_calls") or []
        if calls:
            return self.produced_calls.get(calls[0]["id"])
        return self.produced.get(_text(message.get("content")))

    def record(self, rec: CallRecord, turn: list[int], calls: tuple[dict[str, Any], ...]) -> None:
        self.calls.append(rec)
        for c in calls:
            self.produced_calls[c["id"]] = turn
        if not calls:
            self.produced[rec.text] = turn


class SessionRoutes(Protocol):
    """The agent-session endpoints (``agent_sessions.TaskSessions``), called with the parsed JSON body."""

    def open(self, body: Any) -> dict[str, Any]: ...

    def finish(self, session: str, body: Any) -> dict[str, Any]: ...

    def abandon(self, session: str) -> dict[str, Any]: ...


class GenerateQueue:
    """One policy's engine, shared by concurrent calls: the calls that queue while it generates go into one ``generate``."""

    def __init__(self, handle: PolicyHandle) -> None:
        self.handle = handle
        self.gen_s = 0.0
        self._jobs: list[tuple[list[GenerationRequest], int, Future[list[Completion]]]] = []
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._serve, name=f"facade-{handle.name}", daemon=True).start()

    def generate(self, requests: list[GenerationRequest], min_version: int) -> list[Completion]:
        fut: Future[list[Completion]] = Future()
        with self._cond:
            if self._closed:
                raise Unavailable("the node is shutting down")
            self._jobs.append((requests, min_version, fut))
            self._cond.notify()
        return fut.result()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    for _, _, fut in self._jobs:
                        fut.set_exception(Unavailable("the node is shutting down"))
                    return
                jobs, self._jobs = self._jobs, []
            held = self.handle.engine.version
            ready = [j for j in jobs if j[1] <= held]  # weights only move forward: ready stays ready
            for _, need, fut in jobs:
                if need > held:
                    fut.set_exception(StaleWeights(f"{self.handle.name} holds v{held}, the sample needs >= v{need}"))
            t0 = time.perf_counter()
            try:
                out = self.handle.generate([r for reqs, _, _ in ready for r in reqs])
            except Exception as e:  # every caller learns of it (a 503)
                for _, _, fut in ready:
                    fut.set_exception(e)
                continue
            finally:
                self.gen_s += time.perf_counter() - t0
            k = 0
            for reqs, _, fut in ready:
                fut.set_result(out[k : k + len(reqs)])
                k += len(reqs)


class ChatFacade:
    """The endpoint over a node's policy handles; ``model`` names the policy of a call outside a sample (default: the first)."""

    def __init__(self, handles: Mapping[str, PolicyHandle], host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 advertise_host: str | None = None) -> None:
        if not handles:
            raise ValueError("the facade needs at least one policy handle")
        self.handles = dict(handles)
        self.api_key = api_key
        self.samples: dict[str, SampleLog] = {}
        self.sessions: SessionRoutes | None = None
        self.lock = threading.Lock()
        self.queues = {p: GenerateQueue(h) for p, h in self.handles.items()}
        self.server = ThreadingHTTPServer((host, port), _handler(self))
        self.server.daemon_threads = True
        bound = str(self.server.server_address[0])
        self.host = advertise_host or (socket.gethostname() if bound in ("0.0.0.0", "::") else bound)
        if not is_loopback(bound):
            log.warning("the agent endpoint listens on %s in plain HTTP: keep it on a trusted network or behind a TLS proxy%s",
                        bound, " (its bearer key travels in clear)" if api_key else ", and it asks for no key")
        self.thread = threading.Thread(target=self.server.serve_forever, name="openai-facade", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        """The advertised base address (``http://host:port``); clients use ``{url}/v1``."""
        return f"http://{self.host}:{self.server.server_address[1]}"

    def base_url(self, token: str) -> str:
        return f"{self.url}/s/{token}/v1"

    @property
    def gen_s(self) -> float:
        return sum(q.gen_s for q in self.queues.values())

    def open_sample(self, policy: str, min_version: int = 0) -> str:
        """A new sample of ``policy``; returns its token (its base URL is ``base_url(token)``)."""
        if policy not in self.handles:
            raise BadRequest(f"this node serves policies {sorted(self.handles)}, not {policy!r}", "policy")
        token = secrets.token_urlsafe(18)
        with self.lock:
            self.samples[token] = SampleLog(policy, min_version)
        return token

    def close_sample(self, token: str) -> list[CallRecord]:
        """The sample's calls; later calls under its token get 404."""
        with self.lock:
            s = self.samples.pop(token, None)
        return s.calls if s else []

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        for q in self.queues.values():
            q.close()

    # ------------------------------------------------------------ one call
    def authorize(self, header: str | None) -> None:
        if self.api_key is None:
            return
        given = (header or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise Unauthorized("a bearer token is required: the node's credential password (credentials/nodes/NAME.json)")

    def policy_for(self, model: str | None) -> str:
        return model if model in self.handles else next(iter(self.handles))

    def render_chat(self, h: PolicyHandle, call: ApiCall, sample: SampleLog | None) -> list[int]:
        """The messages (and tools) through the policy's chat template (``chat_template.CHAT_TEMPLATE`` for a tokenizer
        without one). An assistant turn this sample produced is re-inserted as its exact token ids, never re-tokenized
        from text: the template renders a placeholder in its place, and the ids go where the placeholder is."""
        messages: list[dict[str, Any]] = []
        turns: list[list[int]] = []
        mark = f"\x00astraflow-turn-{secrets.token_hex(8)}-{{}}\x00"  # where a produced turn's exact ids go
        for m in call.messages:
            ids = sample.turn_ids(m) if sample is not None and m["role"] == "assistant" else None
            if ids is None:
                messages.append(m)
            else:
                messages.append({"role": "assistant", "content": mark.format(len(turns))})
                turns.append(ids)
        template = None if getattr(h.tokenizer, "chat_template", None) else CHAT_TEMPLATE
        tools = list(call.tools.tools) if call.tools is not None else None
        try:
            text = h.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                   chat_template=template)
        except Exception as e:  # the template's own checks (roles that must alternate, …): the request's fault
            raise BadRequest(f"the model's chat template refused the messages: {type(e).__name__}: {e}", "messages") from None
        out: list[int] = []
        for k, ids in enumerate(turns):
            before, _, text = text.partition(mark.format(k))
            out += h.encode(before) + ids
            end = h.tokenizer.decode(ids[-1:]) if ids and ids[-1] in h.tokenizer.all_special_ids else ""
            text = text[len(end) :] if end and text.startswith(end) else text  # the turn's own end-of-turn token, once
        return out + h.encode(text)

    def render_prompt(self, h: PolicyHandle, prompt: str | list[int], sample: SampleLog | None) -> list[int]:
        """A completions prompt: token ids as given, or text encoded as the workflows encode task prompts (no EOS).
        Text extending an earlier call of the sample (its prompt + what it returned) reuses that call's exact ids."""
        if isinstance(prompt, list):
            vocab = len(h.tokenizer)
            if max(prompt) >= vocab:
                raise BadRequest(f"prompt token id {max(prompt)} is outside the vocabulary ({vocab})", "prompt")
            return prompt
        for c in reversed(sample.calls if sample is not None else []):
            seen = None if c.prompt_text is None else c.prompt_text + c.text
            if seen is not None and prompt.startswith(seen) and (c.text or len(prompt) > len(seen)):  # not a plain retry
                return c.prompt_ids + c.completion_ids + (h.encode(prompt[len(seen) :]) if len(prompt) > len(seen) else [])
        return h.encode(prompt)

    def serve(self, kind: Kind, body: Any, token: str | None) -> tuple[ApiCall, dict[str, Any] | list[dict[str, Any]]]:
        """Generate for one request; returns the call and its response body (a list of SSE payloads when streaming)."""
        call = parse_call(kind, body)
        with self.lock:
            sample = self.samples.get(token) if token is not None else None
        if token is not None and sample is None:
            raise NotFound("no open sample with this token (finished, abandoned or expired)")
        policy = sample.policy if sample is not None else self.policy_for(call.model)
        h = self.handles[policy]
        prefix_text = call.tools.prefix() if call.tools is not None else ""
        prefix = h.encode(prefix_text) if prefix_text else []
        prompt = (self.render_chat(h, call, sample) if call.kind == "chat" else self.render_prompt(h, call.prompt, sample)) + prefix
        if h.context is not None and len(prompt) >= h.context:
            raise BadRequest(f"the prompt is {len(prompt)} tokens; {policy} holds {h.context}", "messages" if kind == "chat" else "prompt")
        base = h.params
        params = replace(base, max_new_tokens=min(call.max_tokens or base.max_new_tokens, base.max_new_tokens),
                         stop=tuple(dict.fromkeys((*base.stop, *call.stop, *(call.tools.stops() if call.tools else ())))),
                         seed=base.seed if call.seed is None else call.seed,
                         temperature=base.temperature if call.temperature is None else call.temperature,
                         top_p=base.top_p if call.top_p is None else call.top_p)
        on_policy = (params.temperature, params.top_p) == (base.temperature, base.top_p)
        comps = self.queues[policy].generate(h.requests([prompt] * call.n, params), sample.min_version if sample else 0)
        shown = (*call.stop, *((CALL_OPEN,) if call.tools is not None and call.tools.mode == "none" else ()))
        choices = []
        for c in comps:
            text = trim_stop(h.decode(c.token_ids), shown)
            reading = read_calls(prefix_text + text, call.tools) if call.kind == "chat" else Reading(text)
            content, finish = reading.content or "", "tool_calls" if reading.calls else c.finish_reason
            choices.append(Choice(content, [h.tokenizer.decode([t]) for t in c.token_ids], list(c.logprobs), finish, reading.calls))
            if sample is not None:
                rec = CallRecord(prompt, list(c.token_ids), list(c.logprobs), list(c.versions), c.finish_reason, content,
                                 on_policy, call.prompt if isinstance(call.prompt, str) and call.kind == "completion" else None,
                                 call.tools is not None, len(reading.calls), reading.failed)
                with self.lock:
                    sample.record(rec, prefix + rec.completion_ids, reading.calls)
        version = max((v for c in comps for v in c.versions), default=h.engine.version)
        use = usage(len(prompt), [len(c.token_ids) for c in comps])
        model = call.model or policy
        if call.stream:
            return call, list(chunks(call, choices, model, f"astraflow-v{version}", use))
        return call, response(call, choices, model, f"astraflow-v{version}", use)

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": p, "object": "model", "created": 0, "owned_by": "astraflow",
                                            "version": h.engine.version} for p, h in self.handles.items()]}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # text parts (checked by parse_call)
        return "".join(p["text"] for p in content)
    return str(content)


class FacadeHandler(JsonHandler):
    """The facade's HTTP routes; :func:`_handler` binds one to its facade."""

    facade: ChatFacade
    protocol_version = "HTTP/1.1"  # keep-alive: every reply has a length, except event streams, which close

    def _route(self) -> tuple[str | None, str]:
        """(sample token or None, path below /v1)."""
        path = self.path.split("?", 1)[0]
        token = None
        if path.startswith("/s/"):
            token, _, rest = path[3:].partition("/")
            path = "/" + rest
        if not path.startswith("/v1/"):
            raise NotFound(f"no route {self.path}")
        return token, path.removeprefix("/v1")

    request_body = b""

    def _body(self) -> Any:
        try:
            return json.loads(self.request_body or b"{}")
        except ValueError as e:
            raise BadRequest(f"the body is not JSON: {e}") from None

    def _answer(self, method: str) -> None:
        self.request_body = self.rfile.read(int(self.headers.get("Content-Length") or 0))  # read first: the connection is kept alive
        try:
            token, path = self._route()
            if token is None:
                self.facade.authorize(self.headers.get("Authorization"))
            if method == "GET" and path == "/models":
                return self._reply(200, self.facade.models())
            if method == "POST" and path in ("/chat/completions", "/completions"):
                _, out = self.facade.serve("chat" if path == "/chat/completions" else "completion", self._body(), token)
                return self._events(out) if isinstance(out, list) else self._reply(200, out)
            if token is None and path.startswith("/sessions"):
                return self._sessions(method, path)
            raise NotFound(f"no route {method} {self.path}")
        except ApiError as e:
            self._reply(e.status, e.body())
        except StaleWeights as e:
            self._reply(409, {"error": {"message": str(e), "type": "stale_weights", "param": None, "code": None}})
        except Exception as e:  # an engine failure: the client may retry
            log.exception("facade call failed")
            self._reply(503, {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error", "param": None, "code": None}})

    def _sessions(self, method: str, path: str) -> None:
        routes = self.facade.sessions
        if routes is None:
            raise NotFound("this node hosts no agent sessions (workflow openai_agent with agent: external does)")
        parts = path.strip("/").split("/")  # sessions[/ID[/finish]]
        if method == "POST" and parts == ["sessions"]:
            return self._reply(200, routes.open(self._body()))
        if method == "POST" and len(parts) == 3 and parts[2] == "finish":
            return self._reply(200, routes.finish(parts[1], self._body()))
        if method == "DELETE" and len(parts) == 2:
            return self._reply(200, routes.abandon(parts[1]))
        raise NotFound(f"no route {method} {self.path}")

    def _events(self, payloads: list[dict[str, Any]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        for p in payloads:
            self.wfile.write(f"data: {json.dumps(p)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def do_DELETE(self) -> None:
        self._answer("DELETE")



def _handler(facade: ChatFacade) -> type[JsonHandler]:
    return type("Handler", (FacadeHandler,), {"facade": facade})
