"""Stopping a task for sure (``runtime.cancel_and_wait``): what every close path of the plane relies on; the event loop a
process runs on (``runtime.run_event_loop``); memory freed kept for the next allocation (``runtime.tune_malloc``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import uvloop

from astraflow.runtime import EVENT_LOOP_ENV, cancel_and_wait, run_event_loop


def a_loop_around_wait_for(arrived: asyncio.Event) -> asyncio.Task[None]:
    """A follower's shape: wait (bounded) for something to arrive, take it, wait again; it ends only when cancelled."""

    async def follow() -> None:
        while True:
            try:
                await asyncio.wait_for(arrived.wait(), 1.0)
            except asyncio.TimeoutError:
                continue
            arrived.clear()

    return asyncio.create_task(follow())


async def test_a_loop_is_stopped_even_when_its_cancellation_comes_as_something_arrives():
    arrived = asyncio.Event()
    if sys.version_info < (3, 12):  # the premise: there, a bare cancel at that moment is swallowed and the loop runs on
        task = a_loop_around_wait_for(arrived)
        await asyncio.sleep(0.01)
        arrived.set()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.3)
        assert not done, "the cancellation was not swallowed: this Python no longer needs cancel_and_wait's second try"
        await cancel_and_wait(task)
        assert task.cancelled()
    task = a_loop_around_wait_for(arrived)
    await asyncio.sleep(0.01)
    arrived.set()
    await asyncio.wait_for(cancel_and_wait(task, every_s=0.05), 5.0)
    assert task.cancelled()


async def test_what_the_tasks_came_to_is_dropped_and_finished_ones_are_left_as_they_are():
    async def fails() -> None:
        raise RuntimeError("boom")

    async def sleeps() -> None:
        await asyncio.sleep(60)

    failed, finished, sleeping = asyncio.create_task(fails()), asyncio.create_task(asyncio.sleep(0, "ok")), asyncio.create_task(sleeps())
    await asyncio.sleep(0.01)
    await cancel_and_wait(failed, finished, sleeping)
    assert finished.result() == "ok" and isinstance(failed.exception(), RuntimeError) and sleeping.cancelled()
    await cancel_and_wait()  # nothing to stop: returns at once


def test_a_process_runs_on_uvloop_unless_it_asks_for_asyncios_own_loop(monkeypatch):
    async def which_loop(x: int) -> tuple[type, int]:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()), x + 1

    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert run_event_loop(which_loop(1)) == (uvloop.Loop, 2)
    monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
    loop_type, two = run_event_loop(which_loop(1))
    assert two == 2 and not issubclass(loop_type, uvloop.Loop)
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    with pytest.raises(ValueError, match=EVENT_LOOP_ENV):
        run_event_loop(which_loop(1))


FAULTS_OF_BLOCKS = """
import resource, sys
import numpy as np
from astraflow.runtime import tune_malloc
tuned = tune_malloc()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
kept = []
for i in range(60):  # 4 MB blocks made, filled and freed, two alive at a time (a step's activations, a version's image)
    if i == 10:
        start = faults()
    kept = [np.ones(1 << 19), *kept][:2]
print(tuned, faults() - start)
"""


def faults_of_blocks(**env: str) -> tuple[bool, int]:
    """Whether a fresh interpreter tuned its malloc, and its page faults over 50 blocks of 4 MB made and freed."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", FAULTS_OF_BLOCKS], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not (hasattr(os, "confstr") and "glibc" in (os.confstr("CS_GNU_LIBC_VERSION") or "")),
                    reason="tunes glibc's malloc only")
def test_memory_freed_goes_to_the_next_block_instead_of_being_faulted_in_again():
    tuned, with_it = faults_of_blocks()
    assert tuned and with_it < 50 * 1024 / 10  # a 4 MB block is 1,024 pages: nearly none faulted in again
    untouched, without = faults_of_blocks(MALLOC_TOP_PAD_="131072")  # glibc's own variable set: left to it
    assert not untouched and without > 10 * with_it
