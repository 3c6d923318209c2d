"""``astraflow up`` as a supervisor: one process per role, restarted when it dies, never orphaned.

A role that exits unexpectedly (a crash, kill -9, an OOM) is started again after a backoff
(1 s, 2 s, 4 s, … up to ``backoff_max_s``); each role resumes from its own durable state (the
trainer from its checkpoints, the dataflow from the run KV, nodes and the evaluator from the
plane). A role that crashes more than ``max_crashes`` times within ``window_s`` is a crash
loop: the run stops and says which role and why (the tail of its log). A trainer or evaluator
that exits 0 has finished and is not restarted; a node retired on purpose is not either.

Children get ``PR_SET_PDEATHSIG = SIGHUP``: if the launcher dies, every role is told at once and
leaves without draining (its server, when embedded, is going away too).

Each role runs in a process group of its own, and what it started goes with it: when a role's process ends, the rest
of its group (an in-process vLLM's engine-core and worker processes, a sandbox, a torchrun's ranks) is sent SIGTERM at
once and SIGKILL when the role is started again (or the run stops), so a role killed again and again does not pile up
orphans holding memory. (A server a node launches in a session of its own is told by the kernel when the node dies:
``rollout/engines/remote.py``.) The terminal's Ctrl-C reaches the launcher alone, which stops every role in order.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from astraflow.train.threads import pin_group

State = Literal["running", "backoff", "done", "retired", "quarantined", "failed"]


_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def _child_setup(nice: int, cores: tuple[int, ...] | None = None) -> Callable[[], None]:
    """The preexec hook of a role started at CPU priority ``nice``, on ``cores`` (None: wherever it may run)."""

    def setup() -> None:
        _hangup_with_parent()
        if nice:
            os.nice(nice)  # a system call of the already loaded interpreter, like those below
        if cores is not None:
            os.sched_setaffinity(0, cores)  # the child is one thread here: every thread it starts inherits it

    return setup


def _hangup_with_parent() -> None:
    """preexec hook: the kernel sends SIGHUP to this child when the launcher dies (Linux), and SIGHUP is not ignored
    (an ignored disposition survives exec: a launcher started under ``nohup`` would pass it on, and a role still
    connecting, before its own handler, would outlive it). Only calls into the already loaded libc run between fork
    and exec (no import, no dlopen, no lock)."""
    if _LIBC is not None:
        _LIBC.signal(signal.SIGHUP, 0)  # SIG_DFL
        _LIBC.prctl(1, signal.SIGHUP)  # PR_SET_PDEATHSIG


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to what is left of the process group of a role whose process ``pgid`` has ended and been reaped.
    A process numbered ``pgid`` alive again is another one: the kernel gives out a number still naming a group only
    once the group is empty, so the group is then someone else's and is left alone."""
    try:
        os.kill(pgid, 0)
        return  # the number was given out again
    except ProcessLookupError:
        pass
    except PermissionError:
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left of it


@dataclass(frozen=True)
class RoleSpec:
    name: str  # process name: trainer-solver, dataflow, evaluator, rollout-0, …
    role: str  # the worker role it runs
    args: tuple[str, ...] = ()
    finishes: bool = False  # exit 0 means done (trainer, evaluator): not restarted
    nice: int = 0  # CPU priority it starts at (its threads inherit it): > 0 yields the cores to the roles at 0
    cores: tuple[int, ...] | None = None  # the CPUs it runs on (None: any it may)


@dataclass
class Child:
    spec: RoleSpec
    proc: subprocess.Popen[bytes]
    log: Path
    state: State = "running"
    restarts: int = 0
    crashes: collections.deque[float] = field(default_factory=collections.deque)
    restart_at: float = 0.0
    last_exit: int | None = None
    cpu_s: float = 0.0  # user + system CPU seconds of its instances that have ended (and what they reaped)

    @property
    def name(self) -> str:
        return self.spec.name

    def alive(self) -> bool:
        """Whether the current instance runs; an ended one is reaped here with ``wait4``, which also gives its CPU time."""
        if self.proc.returncode is not None:
            return False
        try:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: its CPU time is lost
            return self.proc.poll() is None
        if pid == 0:
            return True
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.cpu_s += usage.ru_utime + usage.ru_stime
        return False


class CrashLoop(RuntimeError):
    def __init__(self, child: Child, tail: str) -> None:
        self.child, self.tail = child, tail
        super().__init__(f"{child.name} crashed {len(child.crashes)} times in a row (last exit {child.last_exit}); "
                         f"stopping the run. Last lines of {child.log}:\n{tail}")


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def exit_text(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


class Supervisor:
    """Starts, watches and restarts role processes; ``poll`` once per launcher loop."""

    def __init__(self, command: Callable[[RoleSpec], list[str]], log_for: Callable[[str], Path],
                 env: dict[str, str] | None = None, max_crashes: int = 5, window_s: float = 120.0, backoff_base_s: float = 1.0,
                 backoff_max_s: float = 30.0, on_restart: Callable[[Child], None] | None = None) -> None:
        self.command, self.log_for, self.env = command, log_for, env or dict(os.environ)
        self.on_restart = on_restart  # told of every restart as it happens (the run directory records it)
        self.max_crashes, self.window_s = max_crashes, window_s
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self.children: dict[str, Child] = {}

    def _spawn(self, spec: RoleSpec, log: Path, note: str) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {note} ===\n".encode())
            f.flush()
            return subprocess.Popen(self.command(spec), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=_child_setup(spec.nice, spec.cores), env={**self.env, "PYTHONUNBUFFERED": "1"},
                                    process_group=0)  # its own group: what it starts can be found, and ended, with it

    def start(self, spec: RoleSpec) -> Child:
        log = self.log_for(spec.name)
        child = Child(spec, self._spawn(spec, log, f"start {spec.name}"), log)
        self.children[spec.name] = child
        return child

    def poll(self, now: float | None = None) -> list[str]:
        """Notice exits, schedule and perform restarts; returns what happened, for the live view.
        Raises :class:`CrashLoop` when a role keeps dying."""
        now = time.monotonic() if now is None else now
        events = []
        for c in self.children.values():
            if c.state == "running" and not c.alive():
                _signal_group(c.proc.pid, signal.SIGTERM)  # what it left behind: SIGKILL follows when it starts again
                c.last_exit = c.proc.returncode
                if c.state == "running" and c.spec.finishes and c.last_exit == 0:
                    c.state = "done"
                    continue
                c.crashes.append(now)
                while c.crashes and now - c.crashes[0] > self.window_s:
                    c.crashes.popleft()
                if len(c.crashes) > self.max_crashes:
                    c.state = "failed"
                    raise CrashLoop(c, log_tail(c.log))
                delay = min(self.backoff_max_s, self.backoff_base_s * 2.0 ** (len(c.crashes) - 1))
                c.state, c.restart_at = "backoff", now + delay
                events.append(f"{c.name} {exit_text(c.last_exit)}; restarting in {delay:.1f}s")
            elif c.state == "backoff" and now >= c.restart_at:
                _signal_group(c.proc.pid, signal.SIGKILL)
                c.restarts += 1
                c.proc = self._spawn(c.spec, c.log, f"restart {c.restarts} of {c.name} after {exit_text(c.last_exit)}")
                c.state = "running"
                events.append(f"restarted {c.name} (restart {c.restarts})")
                if self.on_restart is not None:
                    self.on_restart(c)
        return events

    def retire(self, name: str) -> None:
        """Stop a child on purpose (a node the pool no longer needs): SIGTERM, it drains and leaves."""
        c = self.children[name]
        c.state = "retired"
        if c.alive():
            c.proc.send_signal(signal.SIGTERM)

    def widen(self, role: str, cores: Sequence[int]) -> list[str]:
        """Every live child of ``role``, with all it started, onto ``cores`` (a restart starts on its spec's again);
        the names of those moved."""
        return [c.name for c in self.live(role) if c.alive() and pin_group(c.proc.pid, cores)]

    def live(self, role: str) -> list[Child]:
        return [c for c in self.children.values() if c.spec.role == role and c.state in ("running", "backoff")]

    @property
    def restarts(self) -> dict[str, int]:
        return {n: c.restarts for n, c in self.children.items()}

    @property
    def cpu_s(self) -> dict[str, float]:
        """CPU seconds per role process, over its instances that have ended (all of them after ``stop``)."""
        return {n: round(c.cpu_s, 2) for n, c in self.children.items()}

    def stop(self, timeout: float) -> None:
        """SIGTERM every child (it drains what it holds), SIGKILL what is left after ``timeout``."""
        for c in self.children.values():
            if c.alive():
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in self.children.values():
            while c.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if c.alive():
                c.proc.kill()
                while c.alive():
                    time.sleep(0.02)
        for c in self.children.values():  # whatever a role left behind, once every role has had its time to drain
            _signal_group(c.proc.pid, signal.SIGKILL)


class LocalPool:
    """``up --autoscale``: start and retire local rollout workers toward the dataflow's advised target.

    At most one change per ``cooldown_s`` (the advice itself has a dead band). Retiring sends
    SIGTERM to the newest node: it finishes the tasks it holds and leaves.
    """

    def __init__(self, sup: Supervisor, spec_for: Callable[[str], RoleSpec], cooldown_s: float = 10.0, max_nodes: int = 64) -> None:
        self.sup, self.spec_for = sup, spec_for
        self.cooldown_s, self.max_nodes = cooldown_s, max_nodes
        self.last = -float("inf")
        self.started = 0

    def act(self, target: int, now: float) -> str | None:
        """Move one node toward ``target``; returns what it did (None: nothing)."""
        live = self.sup.live("rollout")
        target = max(0, min(target, self.max_nodes))
        if target == len(live) or now - self.last < self.cooldown_s:
            return None
        self.last = now
        if target > len(live):
            i = next(i for i in range(len(self.sup.children) + 1) if f"rollout-{i}" not in self.sup.children)
            self.sup.start(self.spec_for(f"rollout-{i}"))
            self.started += 1
            return f"started rollout-{i} ({len(live) + 1}/{target})"
        newest = live[-1]
        self.sup.retire(newest.name)
        return f"retiring {newest.name} ({len(live) - 1}/{target})"
