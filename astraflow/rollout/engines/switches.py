"""Partial rollouts on an engine that installs a weight version while its requests run (vLLM): which tokens came after.

At each install, vLLM's worker reports how many tokens every request it knows of had sampled (``generated``; the
extension's ``astraflow_install``), keyed by vLLM's own request ids: the caller's id plus ``-`` and a random suffix
(``vllm/v1/engine/input_processor.py``, ``assign_request_id``). A request's tokens from that count on were sampled by
the new weights. The worker reports the requests it still holds and those it dropped since the last install (finished,
with their final count); a request it never held had sampled nothing yet (it was waiting to be scheduled), so all of its
tokens are the new version's.

    versions[j] = v_i for the last switch i with b_i <= j (the request's first version where there is none)
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

Switch = tuple[int, int]  # (version installed, tokens the request had sampled before it)


def sampled_before(generated: Mapping[str, int], request_id: str) -> int:
    """Tokens ``request_id`` (the caller's id) had sampled at an install: vLLM's id is it, or it with a suffix; 0: none."""
    if request_id in generated:
        return generated[request_id]
    prefix = request_id + "-"
    return next((n for key, n in generated.items() if key.startswith(prefix) and "-" not in key[len(prefix):]), 0)


def token_versions(first: int, n: int, switches: Sequence[Switch]) -> list[int]:
    """The version of each of ``n`` tokens: ``first`` until the first switch's boundary, then each switch's version."""
    versions = [first] * n
    for version, boundary in switches:
        versions[boundary:] = [version] * max(0, n - boundary)
    return versions


class InFlight:
    """The requests an engine has running and the installs that land meanwhile (thread-safe).

    ``lock`` makes a request's start (the version it starts under, and its registration) atomic with an install (its
    switch recorded, the engine's version moved on): a request either started before the install and sees its switch,
    or starts after it under the new version.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._open: dict[str, list[tuple[int, Mapping[str, int]]]] = {}
        self.switched = 0  # installs that landed while requests ran

    def start(self, ids: Iterable[str]) -> None:
        """Register ``ids`` (call holding ``lock``, with the engine's version read there)."""
        for i in ids:
            self._open[i] = []

    def record(self, version: int, generated: Mapping[str, int]) -> None:
        """An install of ``version`` landed (call holding ``lock``, with the engine's version set there)."""
        if self._open:
            self.switched += 1
        for switches in self._open.values():
            switches.append((version, generated))

    def finish(self, request_id: str, served_as: str | None = None) -> list[Switch]:
        """``request_id`` is done: the installs that landed while it ran, with its boundary at each, read under
        ``served_as`` (the id the engine says it used; default ``request_id``)."""
        with self.lock:
            seen = self._open.pop(request_id, [])
        return [(version, sampled_before(generated, served_as or request_id)) for version, generated in seen]
