"""``hf`` engine: transformers in-process, batched generation with KV cache (CPU or GPU)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from astraflow.models import decode_text
from astraflow.moe_routing import Routes, RoutingRecorder
from astraflow.registry import ENGINES
from astraflow.rollout.engines.base import Completion, GenerationRequest, SamplingParams
from astraflow.rollout.engines.options import HfOptions
from astraflow.rollout.engines.sampler import Stopped, decode_run, generate_run, runs_itself
from astraflow.rollout.engines.shared_prefill import shared_prefill
from astraflow.weights.load import copy_weights


def stop_at(tokenizer: Any, toks: list[int], stops: tuple[str, ...]) -> int | None:
    """Length of the shortest prefix of ``toks`` whose text contains a stop string (None: no stop string)."""
    if not stops or not any(s in decode_text(tokenizer, toks) for s in stops):
        return None
    for k in range(1, len(toks) + 1):
        if any(s in decode_text(tokenizer, toks[:k]) for s in stops):
            return k
    return None


@dataclass
class _Call:
    """One ``generate`` call waiting for a batch: its requests, then its completions (in order) or the batch's error."""

    requests: list[GenerationRequest]
    out: dict[int, Completion] = field(default_factory=dict)  # by request index
    error: Exception | None = None
    done: bool = False


def gather_wait(waiting: int, callers: int, free_for: float, patience: float) -> float:
    """Seconds a free engine waits before it starts a batch of the ``waiting`` calls (0: now).

    A batch short of the expected ``callers`` waits for the rest until the engine has been free for ``patience``
    (``gather`` x the last batch's time): wait = max(0, patience − free_for). A node's slots re-admit their next task
    some ms after their batch ends (publish, pull, weight load); starting whoever came first alone splits one batch into
    two for good, each half ending while the other runs. On CPU, 8 + 56 sequences cost 1.3x the CPU of 64 in one batch.
    """
    if not waiting or waiting >= callers:
        return 0.0
    return max(0.0, patience - free_for)


def by_params(calls: list[_Call]) -> list[list[tuple[_Call, int]]]:
    """The requests of ``calls`` as (call, request index), grouped into batches of one sampling params each; a seeded
    request stays with its own call's (a seed reproduces a call, not a mixed batch)."""
    groups: dict[Any, list[tuple[_Call, int]]] = {}
    for k, call in enumerate(calls):
        for i, r in enumerate(call.requests):
            groups.setdefault((r.params, k if r.params.seed is not None else -1), []).append((call, i))
    return list(groups.values())


class HFEngine:
    """Generates batches with its own decoding loop (``sampler.py``) and reports per-token behaviour logprobs and versions.

    The behaviour logprob is ``log_softmax(logits / T)`` of the sampled token: the distribution
    the token was actually drawn from (top-p aside), which the trainer recomputes the same way.
    The engine runs one batch or one weight load at a time (``_busy``, under a monitor), so a
    token's version is always the version of the weights that produced it. A model with several LoRA adapters (peft;
    ``shared_base.py``) generates each request with its ``adapter``, requests of different adapters in one batch
    (peft's mixed-adapter batches), each token under the version of its adapter (``adapter_versions``). A load waits for the
    batch in flight, or with ``partial_rollouts`` for its current decoding step only: the batch
    pauses, the load runs, and the batch goes on under the new version (``_generate``).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, device: str = "cpu", gather: float = 0.5,
                 partial_rollouts: bool = False) -> None:
        self.model: Any = model.to(device).eval()  # a transformers causal LM (generate)
        self.tokenizer = tokenizer
        self.device = device
        self.gather = gather
        self.partial_rollouts = partial_rollouts  # a load waiting pauses a generation between decoding steps
        self.switches = 0  # generations that went on under a newer version
        self._version = -1
        self._engine = threading.Condition()  # guards the state below; the model itself runs outside it
        self._busy = False  # a batch or a weight load runs: one at a time
        self._waiting: list[_Call] = []  # calls queued for the next batch
        self._free_since = 0.0  # monotonic time the last batch or load ended
        self._batch_s = 0.0  # wall time of the last batch
        self._callers = 1  # threads that call at once (a node's slots: ``expect_callers``)
        self._loads_waiting = 0  # loads waiting for the engine: they go before new batches (and paused ones)
        self._paused = 0  # generations paused for a load (``partial_rollouts``): they go before new batches
        self._routing: RoutingRecorder | None = None  # records each token's experts (``record_routing``)
        self.adapter_versions: dict[str, int] = {}  # the version each LoRA adapter of the model holds (shared_base.py)

    @cached_property
    def _ends(self) -> tuple[int, int]:
        """The tokenizer's (pad, eos) ids, read once: a transformers tokenizer looks each up anew (about 25 µs)."""
        return self.tokenizer.pad_token_id, self.tokenizer.eos_token_id

    @property
    def version(self) -> int:
        return self._version

    def state_view(self) -> Mapping[str, torch.Tensor]:
        return dict(self.model.state_dict())

    def close(self) -> None:
        """Nothing to release: the model is an in-process module, freed with the engine."""

    def record_routing(self) -> None:
        """Completions carry their positions' experts from now on (``moe_routing.py``; ValueError: not an MoE model)."""
        self._routing = self._routing or RoutingRecorder(self.model)

    @torch.no_grad()
    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        with self._held():
            copy_weights(self.model, state, f"weight version {version}")
            self._version = version

    @torch.no_grad()
    def update(self, write: Callable[[], None], version: int, adapter: str | None = None) -> None:
        """Run ``write`` (it changes the model's weights) holding the engine, as a load does; then the model (or its
        ``adapter``) is at ``version``."""
        with self._held():
            write()
            if adapter is None:
                self._version = version
            else:
                self.adapter_versions[adapter] = version

    @contextmanager
    def _held(self) -> Iterator[None]:
        """Hold the engine (no batch, no other load) for the block: a load waits for the batch in flight."""
        with self._engine:
            self._loads_waiting += 1
            try:
                self._engine.wait_for(lambda: not self._busy)
            finally:
                self._loads_waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            with self._engine:
                self._free()

    def _free(self) -> None:
        """The batch or load that held the engine ended (called holding the monitor): wake whoever waits."""
        self._busy = False
        self._free_since = time.monotonic()
        self._engine.notify_all()

    def set_version(self, version: int) -> None:
        self._version = version

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Generate ``requests``, batched with whatever other threads asked for meanwhile.

        A node runs one workflow call per generation slot, so calls arrive concurrently. The thread
        that gets the engine next generates every call waiting at that moment (one batched
        ``generate`` per distinct sampling params), so concurrent slots share batches on CPU as one
        pulled batch did; a call that arrives while a batch runs joins the next one, and a batch
        short of the expected callers (a node's slots) waits a little for them (``_gather_wait``).
        """
        if not requests:
            return []
        call = _Call(requests)
        with self._engine:
            self._waiting.append(call)
            self._engine.notify_all()
            while not call.done:
                wait = self._gather_wait()
                if wait > 0:
                    self._engine.wait(wait)
                    continue
                batch, self._waiting, self._busy = self._waiting, [], True
                self._engine.release()  # generate outside the monitor: new calls queue meanwhile
                t0 = time.monotonic()
                try:
                    self._run(batch)
                finally:
                    for other in batch:  # interrupted (``_run`` hands an Exception to every call itself)
                        if not other.done:
                            other.error, other.done = RuntimeError("the batch was interrupted"), True
                    self._engine.acquire()
                    self._free()
                    self._batch_s = self._free_since - t0
        if call.error is not None:
            raise call.error
        return [call.out[i] for i in range(len(requests))]

    def expect_callers(self, n: int) -> None:
        """``n`` threads call ``generate`` at once (a node's generation slots): a batch waits a little for all of them."""
        with self._engine:
            self._callers = max(1, n)

    def _gather_wait(self) -> float:
        """Seconds to wait before the next batch starts (0: start it now; called holding the monitor)."""
        if self._busy or self._loads_waiting or self._paused:
            return 1.0  # woken when it ends: a load waiting, then a paused generation, go first
        return gather_wait(len(self._waiting), self._callers, time.monotonic() - self._free_since, self.gather * self._batch_s)

    def _run(self, calls: list[_Call]) -> None:
        """Generate every call of ``calls`` (the engine held); each gets its completions or the error."""
        try:
            for members in by_params(calls):
                for (call, i), c in zip(members, self._generate([call.requests[i] for call, i in members]), strict=True):
                    call.out[i] = c
        except Exception as e:
            for call in calls:
                call.error = e
        for call in calls:
            call.done = True

    def _let_loads_in(self) -> None:
        """A generation paused between decoding steps (the engine held): let the loads waiting run, then hold it again."""
        with self._engine:
            self._paused += 1
            self._free()
            self._engine.wait_for(lambda: not self._busy and not self._loads_waiting)
            self._paused -= 1
            self._busy = True
            self.switches += 1

    @torch.no_grad()
    def _generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """One batch of same-params requests; with ``partial_rollouts`` a weight load waiting pauses it between decoding
        steps, and the rows still decoding go on under the new weights from their prompt and tokens so far (the KV
        cache is recomputed by the new weights). Each token keeps the version that sampled it."""
        params = requests[0].params
        if params.seed is not None:
            torch.manual_seed(params.seed)
        rows = [_Row(list(r.prompt_ids), adapter=r.adapter) for r in requests]
        while True:
            live = [row for row in rows if row.reason is None]
            if not live:
                break
            if self._decode(live, params):
                self._let_loads_in()
        return [Completion(row.tokens, row.logprobs, row.versions, row.reason or "length", row.routes()) for row in rows]

    def _decode(self, rows: list[_Row], params: SamplingParams) -> bool:
        """Decode ``rows`` (prompt + tokens so far) until each finishes, or until a weight load is waiting (then True)."""
        contexts = [row.prompt + row.tokens for row in rows]
        pad, eos = self._ends
        ids, att = left_padded(contexts, pad)
        interrupt = (lambda: self._loads_waiting > 0) if self.partial_rollouts else None
        versions = [self._version if row.adapter is None else self.adapter_versions.get(row.adapter, -1) for row in rows]
        adapters = {"adapter_names": [row.adapter or "__base__" for row in rows]} if any(row.adapter for row in rows) else {}
        steps = params.max_new_tokens - min(len(row.tokens) for row in rows)
        if self._routing is not None:
            self._routing.start()
        # a group's samples share their prompt: read once (not under LoRA adapters or routing records, which follow rows)
        cached = shared_prefill(self.model, ids, att) if not adapters and self._routing is None else {}
        if runs_itself(self.model):
            run = decode_run(self.model, ids, att, params, steps, pad=pad, eos=eos,
                             cached=cached, forward=adapters, stopped=stop_seen(self.tokenizer, rows, params.stop), interrupt=interrupt)
        else:
            run = generate_run(self.model, ids, att, params, steps, tokenizer=self.tokenizer, cached=cached, forward=adapters,
                               interrupt=interrupt)
        for i, row in enumerate(rows):
            row.extend(self.tokenizer, run.tokens[i].tolist(), run.logprobs[i].tolist(), versions[i], params, pad, eos)
        if self._routing is not None:  # this run re-read each row's context: its routes replace the row's (``_Row.routes``)
            for row, routes in zip(rows, self._routing.rows([len(c) for c in contexts], ids.shape[1]), strict=True):
                row.routing = routes
        return run.interrupted and any(row.reason is None for row in rows)


def stop_seen(tokenizer: Any, rows: list[_Row], stops: tuple[str, ...]) -> Stopped | None:
    """Whether a row's text now holds one of ``stops``, given its tokens of this run (None: no stop strings).

    Only the text of the row's last tokens is read: a stop string of n characters spans at most 4n tokens of a
    byte-level tokenizer, fewer of a subword one. A stop string missed here costs decoding on to the budget, and one
    seen in a tail's text but not in the whole row's costs a second run; ``_Row.extend`` cuts the row where the stop
    string completes either way."""
    if not stops:
        return None
    tail = 4 * max(len(s) for s in stops) + 4
    return lambda i, new: any(s in decode_text(tokenizer, (rows[i].tokens + new)[-tail:]) for s in stops)


def left_padded(contexts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), each (B, W): ``contexts`` left-padded to the longest."""
    width = max(len(c) for c in contexts)
    ids = np.full((len(contexts), width), pad, dtype=np.int64)
    att = np.zeros_like(ids)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = c
        att[i, width - len(c):] = 1
    return torch.from_numpy(ids), torch.from_numpy(att)


@dataclass
class _Row:
    """One request's completion as it grows: a row of one or more decoding runs (one per weight version)."""

    prompt: list[int]
    adapter: str | None = None  # the LoRA adapter generating it (None: the model as loaded)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reason: str | None = None  # None: still decoding
    routing: Routes | None = None  # the experts of its positions, as the last decoding run routed them

    def routes(self) -> Routes | None:
        """The routed positions that shape the completion's logprobs: prompt + tokens - 1 (the last run routed steps
        past a row's end while others went on, and a stop string may have cut tokens)."""
        return None if self.routing is None else self.routing.head(len(self.prompt) + len(self.tokens) - 1)

    def extend(self, tokenizer: Any, toks: list[int], logps: list[float], version: int, params: SamplingParams, pad: int,
               eos: int) -> None:
        """Append a decoding run's tokens (up to the row's end: ``eos``, ``pad``) and settle whether the row finished."""
        n, reason = len(toks), None
        if eos in toks:
            n, reason = toks.index(eos) + 1, "stop"  # keep the EOS token: it is a decision too
        elif pad in toks:
            n, reason = toks.index(pad), "length"  # padded after a stop string (found below), or a pad sampled
        n = min(n, params.max_new_tokens - len(self.tokens))
        self.tokens += toks[:n]
        self.logprobs += logps[:n]
        self.versions += [version] * n
        k = stop_at(tokenizer, self.tokens, params.stop)
        if k is not None:  # keep the stop string: the model chose it
            self.tokens, self.logprobs, self.versions, reason = self.tokens[:k], self.logprobs[:k], self.versions[:k], "stop"
        if reason is None and len(self.tokens) >= params.max_new_tokens:
            reason = "length"
        self.reason = reason


@ENGINES.register("hf", HfOptions)
def build_hf(options: HfOptions, model_cfg: Any, rollout_cfg: Any, tokenizer: Any) -> HFEngine:
    from astraflow.models import build_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(model_cfg, tokenizer)
    if options.dtype != "model":
        model = model.to(getattr(torch, options.dtype))
    return HFEngine(model, tokenizer, device=device, gather=options.gather, partial_rollouts=rollout_cfg.partial_rollouts)
