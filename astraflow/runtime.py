"""What every role process shares: stop signals, a heartbeat loop, periodic tasks, stopping a task for sure, the crash
points of the kill tests, and how it tunes its process (garbage collector, malloc, CPU priority)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import io
import logging
import os
import signal
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from astraflow.streams.plane import Plane

log = logging.getLogger(__name__)
CRASH_ENV = "ASTRAFLOW_CRASH"
_crossed: Counter[str] = Counter()
_T = TypeVar("_T")


def crash_point(where: str, at: int | None = None) -> None:
    """Fault injection for the kill tests: ``ASTRAFLOW_CRASH=where@n`` SIGKILLs this process (from any thread) at
    ``where`` when ``n`` is ``at`` (what the caller counts: the trainer passes its version) or, where the caller
    passes none, the n-th time this process passes ``where``.

    Trainer points (n = version): ``after_step``, ``after_snapshot`` (the checkpoint copied in memory, not written),
    ``during_checkpoint_write`` (its files written, not yet renamed into place), ``after_checkpoint`` (durable),
    ``before_announce`` (the version's payload stored, not announced), ``after_publish`` (announced, its batch not
    yet held), ``after_ack`` (that version's batch acked), ``between_acks`` (after the first of a group of held acks).
    Dataflow points (n = crossing): ``batch_planned``, ``batch_published``."""
    point, _, n = os.environ.get(CRASH_ENV, "").partition("@")
    if point != where:
        return
    if at is None:
        _crossed[where] += 1
        at = _crossed[where]
    if at == int(n or 1):
        log.warning("crash point %s@%d: SIGKILL", where, at)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


class Stop(asyncio.Event):
    """Set when a role must leave. ``urgent``: leave now, without draining (the launcher died, or
    the server has been gone too long: nothing held could be handed back anyway)."""

    def __init__(self) -> None:
        super().__init__()
        self.urgent = False
        self.why = ""

    def now(self, why: str) -> None:
        self.urgent, self.why = True, why
        self.set()


ORPHAN_EXIT_S = 2.0  # a role whose launcher died is gone within this, whatever it was doing


def stop_event() -> Stop:
    """SIGTERM / SIGINT: finish what you hold and leave. SIGHUP (sent by the kernel when the launcher
    dies, ``PR_SET_PDEATHSIG``): leave now, and in any case within ``ORPHAN_EXIT_S`` (a step that
    blocks the loop must not keep an orphan alive; what it held is redelivered to the next life)."""
    stop = Stop()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def orphaned(signum: int, frame: object) -> None:  # runs between bytecodes, even inside a blocking step
        timer = threading.Timer(ORPHAN_EXIT_S, os._exit, (1,))
        timer.daemon = True
        timer.start()
        loop.call_soon_threadsafe(stop.now, "the launcher is gone (SIGHUP)")

    signal.signal(signal.SIGHUP, orphaned)
    loop.add_signal_handler(signal.SIGUSR2, log_tasks)
    return stop


def log_tasks() -> None:
    """SIGUSR2: log what every task of the role's event loop is waiting on (``kill -USR2 PID``, for a role that seems stuck)."""
    buf = io.StringIO()
    for task in asyncio.all_tasks():
        buf.write(f"--- {task.get_name()}\n")
        coro: Any = task.get_coro()
        while coro is not None:  # the chain of awaits, outermost first
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                buf.write(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}\n")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    log.warning("SIGUSR2: the role's tasks and where each waits:\n%s", buf.getvalue())


async def watch_server(plane: Plane, stop: Stop, bound_s: float) -> None:
    """Leave (urgently) once the server has been unreachable for ``bound_s`` seconds; shorter outages
    (a restart, a leaf region's link) are ridden through by the client's reconnects."""
    while not stop.is_set():
        gone = plane.disconnected_for()
        if gone > bound_s:
            log.error("nats-server unreachable for %.0fs (bound %.0fs): leaving", gone, bound_s)
            stop.now(f"server gone for {gone:.0f}s")
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def cancel_and_wait(*tasks: asyncio.Future[Any], every_s: float = 1.0) -> None:
    """Cancel ``tasks`` and return once every one has ended, whatever it came to (results and errors are dropped). One
    still running after ``every_s`` is cancelled again: before Python 3.12, ``asyncio.wait_for`` swallows a cancellation
    that comes just as what it waits for finishes (CPython gh-86296), and a loop around it would then run on forever."""
    running = {t for t in tasks if not t.done()}
    while running:
        for t in running:
            t.cancel()
        _, running = await asyncio.wait(running, timeout=every_s)
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: never reported as "never retrieved"


async def every(seconds: float, fn: Callable[[], Awaitable[object]], stop: asyncio.Event) -> None:
    """Run ``fn`` every ``seconds`` until ``stop``; an error is logged, never fatal."""
    while not stop.is_set():
        try:
            await fn()
        except Exception as e:  # a failed heartbeat must not kill a worker
            log.warning("periodic %s failed: %s", getattr(fn, "__name__", fn), e)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("nats", "httpx", "httpx2", "httpcore", "openai", "urllib3"):  # a request line per agent call is noise
        logging.getLogger(noisy).setLevel(logging.WARNING)


YOUNG_GC_THRESHOLD = 50_000  # net new container objects between collections of the youngest generation (CPython: 700)


def tune_gc() -> None:
    """Fewer, cheaper cyclic garbage collections for a long-running role (call it once its code is imported).

    What start-up built (modules, classes, configs) is frozen out of every later collection, and the youngest
    generation is collected every ``YOUNG_GC_THRESHOLD`` net allocations instead of 700. A role's messages are freed by
    reference counting as they are handled, so the collector found little; at CPython's threshold it still ran about
    50 times a second on the plane's path and took ~11 % of the CPU per trajectory (``benchmarks/bench_plane.py``)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, older, oldest)


MMAP_THRESHOLD = 32 << 20  # bytes: blocks under this come from the heap (glibc's largest: half its 64 MB heap)
TRIM_THRESHOLD = 128 << 20  # bytes free at the top of the main heap before glibc hands memory back to the kernel
TOP_PAD = 16 << 20  # bytes free kept at the top of a heap it trims, a thread's heaps too
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")  # glibc's own: set, all are kept


def tune_malloc() -> bool:
    """Memory freed goes to the next allocation, not back to the kernel (glibc; True when set). A role's work
    allocates and frees the same blocks over and over: a training step its activations and gradients (in the step's
    thread), a node its generation's, the trainer each version's image. At glibc's defaults a block over 128 KB (a
    threshold that rises with the largest freed) is mapped for it alone, and freed memory at the top of a heap is given
    back to the kernel, so the next block is faulted in and zeroed page by page again: about 1,150 page faults a step
    and image of the recipe's model in a thread, 10-30 with these settings (BENCHMARKS.md). The price: up to
    ``TOP_PAD`` per heap, and ``TRIM_THRESHOLD`` in the main one, held beyond what the role uses. Values set through
    glibc's own variables (``MALLOC_ENV``) are left as they are; another libc is left alone."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return all(mallopt(param, value) for param, value in
               ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD)))


def lower_priority(nice: int) -> bool:
    """Run every thread of this process, and those it starts later (they inherit it), at CPU priority ``nice`` where
    that is lower than this thread's now (raising one needs a privilege). False where nothing changed."""
    if not sys.platform.startswith("linux") or os.getpriority(os.PRIO_PROCESS, 0) >= nice:
        return False
    for tid in os.listdir("/proc/self/task"):  # a thread's priority is its own on Linux
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return True


EVENT_LOOP_ENV = "ASTRAFLOW_EVENT_LOOP"


def run_event_loop(main: Coroutine[Any, Any, _T]) -> _T:
    """Run a process's main coroutine to the end, on uvloop where it is installed (``ASTRAFLOW_EVENT_LOOP=asyncio``
    keeps asyncio's own loop).

    A role's event loop turns many times for each message it reads (timers, hand-offs from its threads, nats-py's
    flushes); uvloop does a turn's polling, scheduling and socket work in C instead of Python."""
    choice = os.environ.get(EVENT_LOOP_ENV, "uvloop")
    if choice not in ("uvloop", "asyncio"):
        main.close()
        raise ValueError(f"{EVENT_LOOP_ENV}={choice!r}: give uvloop or asyncio")
    factory = None
    if choice == "uvloop":
        try:
            import uvloop
            factory = uvloop.new_event_loop
        except ImportError:
            log.debug("uvloop is not installed: asyncio's own event loop")
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
