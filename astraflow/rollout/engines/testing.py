"""A deterministic engine that replies with scripted text, for testing workflows without a model.

Not a registered engine (``scripted`` is the benchmark engine): tests and recipe authors build
it directly. ``reply(prompt_text) -> text`` decides each completion; the text is tokenized,
cut at the first stop string (kept, finish "stop") or at ``max_new_tokens`` (finish
"length"), and otherwise ends with EOS. Every token gets logprob ``logprob`` and the engine's
current version, which ``load_state`` sets (the state itself is ignored).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from astraflow.models import decode_text, encode_prompt
from astraflow.rollout.engines.base import Completion, GenerationRequest


class ScriptEngine:
    def __init__(self, tokenizer: Any, reply: Callable[[str], str], version: int = 0, logprob: float = -0.25) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self._version = version
        self.logprob = logprob
        self.calls: list[list[GenerationRequest]] = []
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self._version

    def state_view(self) -> Mapping[str, Any]:
        return {}

    def expect_callers(self, n: int) -> None:
        """Nothing to do: replies are scripted, one call at a time."""

    def close(self) -> None:
        """Nothing to release."""

    def load_state(self, state: Mapping[str, Any], version: int) -> None:
        with self._lock:
            self._version = version

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        with self._lock:
            self.calls.append(list(requests))
            return [self._one(r) for r in requests]

    def _one(self, r: GenerationRequest) -> Completion:
        text = self.reply(decode_text(self.tokenizer, r.prompt_ids))
        reason = "stop"
        cut = [text.index(s) + len(s) for s in r.params.stop if s in text]
        ids = encode_prompt(self.tokenizer, text[:min(cut)]) if cut else encode_prompt(self.tokenizer, text) + [self.tokenizer.eos_token_id]
        if len(ids) > r.params.max_new_tokens:
            ids, reason = ids[: r.params.max_new_tokens], "length"
        return Completion(ids, [self.logprob] * len(ids), [self._version] * len(ids), reason)
