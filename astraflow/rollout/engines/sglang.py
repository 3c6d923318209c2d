"""``sglang`` engine: an SGLang server, launched by the node or attached (``rollout.engine: {type: sglang, url: ...}``).

UNVERIFIED against a real SGLang server in this repository's CI (no GPU): written against
SGLang's documented native HTTP API and tested against a fake server that speaks it
(``tests/test_rollout_engines.py``). See ``docs/rollout.md`` for what was and was not run.

- generate: ``POST /generate`` with ``input_ids`` (a batch), ``sampling_params``
  (``max_new_tokens``, ``temperature``, ``top_p``, ``stop``, ``no_stop_trim``, ``sampling_seed``)
  and ``return_logprob``. Token ids and logprobs come from ``meta_info.output_token_logprobs``
  (``[logprob, token_id, text]`` per token); the version of the tokens is the server's
  ``meta_info.weight_version`` (we set it on every update), else the node's version.
  SGLang's logprobs are of the temperature-scaled distribution (its default), which is what
  the trainer recomputes.
- apply a weight version: the bf16 state is staged as a model directory, then
  ``POST /pause_generation`` (mode ``retract``) → ``POST /update_weights_from_disk`` (``model_path``,
  ``weight_version``) → ``POST /flush_cache`` → ``POST /continue_generation``. The node's own
  generations never overlap an update (a read/write lock); the pause covers other clients of
  a shared server.
- launch: ``python -m sglang.launch_server --model-path M --host 127.0.0.1 --port P
  [args]``, healthy when ``GET /health`` answers 200.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from astraflow.registry import ENGINES
from astraflow.rollout.engines.base import Completion, SamplingParams
from astraflow.rollout.engines.options import SglangOptions
from astraflow.rollout.engines.remote import EngineHTTPError, RemoteEngine, ServerProcess, free_port, prepare


class EngineAborted(RuntimeError):
    """The server aborted a request (e.g. an operator paused it in abort mode); the task is retried."""


def sampling_params(p: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p,
                           "no_stop_trim": True, "skip_special_tokens": False}
    if p.stop:
        out["stop"] = list(p.stop)
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    return out


def parse_output(item: Mapping[str, Any], fallback_version: int) -> Completion:
    meta = item.get("meta_info") or {}
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, Mapping) else str(reason)
    if kind == "abort":
        raise EngineAborted(f"sglang aborted the request: {reason}")
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise EngineHTTPError("/generate", 200, "reply has no meta_info.output_token_logprobs (return_logprob ignored?)")
    ids = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) for t in triples]
    try:
        version = int(meta.get("weight_version", fallback_version))
    except (TypeError, ValueError):  # a server started without a numeric version ("default")
        version = fallback_version
    return Completion(ids, logprobs, [version] * len(ids), "length" if kind == "length" else "stop")


class SGLangEngine(RemoteEngine):
    def generate_group(self, prompts: list[list[int]], params: SamplingParams, version: int) -> list[Completion]:
        reply = self.post("/generate", {"input_ids": prompts, "sampling_params": sampling_params(params), "return_logprob": True})
        items = reply if isinstance(reply, list) else [reply]
        if len(items) != len(prompts):
            raise EngineHTTPError(f"{self.url}/generate", 200, f"{len(items)} outputs for {len(prompts)} prompts")
        return [parse_output(item, version) for item in items]

    def load_state(self, state: Mapping[str, Any], version: int) -> None:
        path = self.stager.stage(state, version)
        with self.lock.write():
            paused = self.post_optional("/pause_generation", {"mode": "retract"})  # others' requests wait, not abort
            try:
                reply = self.post("/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)})
                if isinstance(reply, Mapping) and reply.get("success") is False:
                    raise EngineHTTPError(f"{self.url}/update_weights_from_disk", 200, str(reply.get("message")))
                self.post_optional("/flush_cache")
            finally:
                if paused:
                    self.post("/continue_generation")
            self._version = version
            self._state = state
        self.stager.commit(path)


def launch_command(model_path: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
            "--port", str(port), *extra]


@ENGINES.register("sglang", SglangOptions)
def build_sglang(options: SglangOptions, model_cfg: Any, rollout_cfg: Any, tokenizer: Any) -> SGLangEngine:
    path, stager = prepare("sglang", model_cfg, options, tokenizer)
    server = None
    url = options.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = ServerProcess(launch_command(path, port, list(options.args)), None, stager.root / "sglang-server.log")
        try:
            server.wait_healthy(url + SGLangEngine.health_path, options.startup_timeout)
        except BaseException:
            server.stop()
            stager.close()
            raise
    return SGLangEngine(url, server, stager, tokenizer)
