"""``hf`` engine: transformers in-process, batched generation with KV cache (CPU or GPU)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from astraflow.rollout.engines.base import Completion, GenerationRequest
from astraflow.rollout.engines.options import HfOptions
from astraflow.rollout.engines.registry import register_engine


def stop_at(tokenizer: Any, toks: list[int], stops: tuple[str, ...]) -> int | None:
    """Length of the shortest prefix of ``toks`` whose text contains a stop string (None: no stop string)."""
    if not stops or not any(s in tokenizer.decode(toks, skip_special_tokens=True) for s in stops):
        return None
    for k in range(1, len(toks) + 1):
        if any(s in tokenizer.decode(toks[:k], skip_special_tokens=True) for s in stops):
            return k
    return None


@dataclass
class _Call:
    """One ``generate`` call waiting for a batch: its requests, then its completions (in order) or the batch's error."""

    requests: list[GenerationRequest]
    out: dict[int, Completion] = field(default_factory=dict)  # by request index
    error: Exception | None = None
    done: bool = False


class HFEngine:
    """Generates with ``model.generate`` and reports per-token behaviour logprobs and versions.

    The behaviour logprob is ``log_softmax(logits / T)`` of the sampled token: the distribution
    the token was actually drawn from (top-p aside), which the trainer recomputes the same way.
    A lock keeps ``generate`` and ``load_state`` apart, so a token's version is always the
    version of the weights that produced it.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, device: str = "cpu") -> None:
        self.model: Any = model.to(device).eval()  # a transformers causal LM (generate)
        self.tokenizer = tokenizer
        self.device = device
        self._version = -1
        self._lock = threading.Lock()  # one batch or one weight load at a time
        self._waiting: list[_Call] = []  # calls queued for the next batch
        self._waiting_lock = threading.Lock()

    @property
    def version(self) -> int:
        return self._version

    def state_view(self) -> Mapping[str, torch.Tensor]:
        return dict(self.model.state_dict())

    @torch.no_grad()
    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        own = self.model.state_dict()
        missing = set(own) - set(state)
        if missing:
            raise ValueError(f"weight version {version} lacks {sorted(missing)[:3]}…")
        with self._lock:
            for name, tensor in own.items():
                tensor.copy_(state[name])
            self._version = version

    def set_version(self, version: int) -> None:
        self._version = version

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Generate ``requests``, batched with whatever other threads asked for meanwhile.

        A node runs one workflow call per generation slot, so calls arrive concurrently. The thread
        that gets the engine next generates every call waiting at that moment (one batched
        ``generate`` per distinct sampling params), so concurrent slots share batches on CPU as one
        pulled batch did; a call that arrives while a batch runs joins the next one.
        """
        if not requests:
            return []
        call = _Call(requests)
        with self._waiting_lock:
            self._waiting.append(call)
        with self._lock:
            if not call.done:
                with self._waiting_lock:
                    batch, self._waiting = self._waiting, []
                self._run(batch)
        if call.error is not None:
            raise call.error
        return [call.out[i] for i in range(len(requests))]

    def _run(self, calls: list[_Call]) -> None:
        """Generate every call of ``calls`` (under the engine lock); each gets its completions or the error."""
        groups: dict[Any, list[tuple[_Call, int]]] = {}
        for k, call in enumerate(calls):  # seeded params stay per call: a seed reproduces a call, not a mixed batch
            for i, r in enumerate(call.requests):
                groups.setdefault((r.params, k if r.params.seed is not None else -1), []).append((call, i))
        try:
            for members in groups.values():
                for (call, i), c in zip(members, self._generate([call.requests[i] for call, i in members]), strict=True):
                    call.out[i] = c
        except Exception as e:
            for call in calls:
                call.error = e
        for call in calls:
            call.done = True

    @torch.no_grad()
    def _generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        params = requests[0].params
        pad = self.tokenizer.pad_token_id
        eos = self.tokenizer.eos_token_id
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, r in enumerate(requests):  # left padding
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            att[i, width - len(r.prompt_ids) :] = 1
        if params.seed is not None:
            torch.manual_seed(params.seed)
        version = self._version
        greedy = params.temperature == 0
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=att.to(self.device),
            max_new_tokens=params.max_new_tokens, do_sample=greedy is False, temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p, top_k=None if greedy else 0, pad_token_id=pad, eos_token_id=eos,
            stop_strings=list(params.stop) or None, tokenizer=self.tokenizer if params.stop else None,
            output_logits=True, return_dict_in_generate=True,
        )
        new = out.sequences[:, width:].cpu()  # (B, T)
        logits = torch.stack(out.logits, dim=1).float().cpu() / (params.temperature or 1.0)  # (B, T, V)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # (B, T)
        completions = []
        for i in range(len(requests)):
            toks = new[i].tolist()
            n, reason = len(toks), "length"
            if eos in toks:
                n, reason = toks.index(eos) + 1, "stop"  # keep the EOS token: it is a decision too
            elif pad in toks:
                n = toks.index(pad)
            k = stop_at(self.tokenizer, toks[:n], params.stop)
            if k is not None:
                n, reason = k, "stop"  # keep the stop string: the model chose it
            completions.append(Completion(toks[:n], logp[i, :n].tolist(), [version] * n, reason))
        return completions


@register_engine("hf", HfOptions)
def build_hf(options: HfOptions, model_cfg: Any, rollout_cfg: Any, tokenizer: Any) -> HFEngine:
    from astraflow.models import build_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return HFEngine(build_model(model_cfg, tokenizer), tokenizer, device=device)
