"""One thread drives an engine object that is not thread-safe (``vllm.LLM``); the others hand it their calls.

A generation holds the engine while it steps it (``driving``). Another thread's call (``call``) runs at once when the
engine is free; otherwise the driver runs it for them at its next safe point: between two engine steps
(``between_steps``) when the call may run in the middle of a generation (``mid_generation``: an RPC that reads, or a
weight install with partial rollouts), or else when the driver lets go. So a worker's weight fetch is polled while a
generation runs, and a version is installed between its decoding steps where the recipe allows it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class _Call:
    fn: Callable[[], Any]
    mid_generation: bool
    result: Any = None
    error: BaseException | None = None
    done: bool = False

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # handed back to the caller's thread
            self.error = e
        finally:
            self.done = True


class EngineTurns:
    """Who holds the engine, and the calls waiting for it (module doc)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._held = False
        self._holder: int | None = None  # the thread that holds the engine
        self._calls: list[_Call] = []

    def call(self, fn: Callable[[], Any], mid_generation: bool = False) -> Any:
        """``fn()`` run with the engine held: now, or by whoever holds it at its next safe point (module doc). The
        holder's own calls (a call made by a call it runs) run at once."""
        if self._holder == threading.get_ident():
            return fn()
        with self._cv:
            if self._held:
                call = _Call(fn, mid_generation)
                self._calls.append(call)
                self._cv.wait_for(lambda: call.done)
                if call.error is not None:
                    raise call.error
                return call.result
            self._held, self._holder = True, threading.get_ident()
        try:
            return fn()
        finally:
            self._let_go()

    @contextmanager
    def driving(self) -> Iterator[None]:
        """Hold the engine for a generation (waits for whoever holds it; runs what was handed over on the way out)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._held)
            self._held, self._holder = True, threading.get_ident()
        try:
            yield
        finally:
            self._let_go()

    def between_steps(self) -> None:
        """The driver, between two engine steps: run the calls handed over that may run mid-generation."""
        self._run_calls(lambda c: c.mid_generation, release=False)

    def _let_go(self) -> None:
        self._run_calls(lambda c: True, release=True)

    def _run_calls(self, eligible: Callable[[_Call], bool], release: bool) -> None:
        while True:
            with self._cv:
                call = next((c for c in self._calls if eligible(c)), None)
                if call is None:
                    if release:
                        self._held, self._holder = False, None
                    self._cv.notify_all()
                    return
                self._calls.remove(call)
            call.run()
            with self._cv:
                self._cv.notify_all()
