"""Run untrusted Python (a model's code) against tests, or an untrusted program in a directory, in a subprocess sandbox.

Isolation, in layers:

- a fresh temporary directory as the working directory, removed afterwards;
- ``python -I`` (no user site, no PYTHON* environment) with an empty environment;
- resource limits set in the child before exec: address space (``RLIMIT_AS``), CPU seconds
  (``RLIMIT_CPU``), file size (``RLIMIT_FSIZE``), open files (``RLIMIT_NOFILE``);
- a wall-clock timeout that kills the whole process group;
- no network: a new network namespace (``unshare -rn``, or ``unshare -n`` as root) when the
  kernel allows it — only a loopback device that is down; otherwise the harness replaces the
  socket module's constructors before the candidate runs (best effort: a determined program
  can reach ``_socket``). ``Sandbox.network_isolation`` says which one is in force.

``Sandbox.exec`` runs one program (argv, no shell) in a given directory under the same limits and
returns its output; the terminal environment (``envs/shell.py``) runs an agent's commands with it.

The harness runs each test (a Python statement, usually an ``assert``) in its own
``try``, so one failing test does not hide the others, and reports through a result file the
candidate cannot guess the name of.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from functools import lru_cache

_HARNESS = r'''
import json, sys
_out, _n = sys.argv[1], int(sys.argv[2])
if sys.argv[3] == "block":
    import socket as _s
    def _blocked(*a, **k):
        raise OSError("network is disabled in the sandbox")
    for _name in ("socket", "create_connection", "create_server", "socketpair", "getaddrinfo"):
        setattr(_s, _name, _blocked)
_res = {"compiled": False, "passed": [False] * _n, "error": ""}
def _save():
    with open(_out, "w") as f:
        json.dump(_res, f)
_save()
_g = {"__name__": "__candidate__"}
try:
    exec(compile(open("candidate.py").read(), "candidate.py", "exec"), _g)
    _res["compiled"] = True
except BaseException as e:
    _res["error"] = f"{type(e).__name__}: {e}"[:500]
    _save()
    sys.exit(0)
_save()
_tests = json.load(open("tests.json"))
for _i, _t in enumerate(_tests):
    try:
        exec(compile(_t, f"test_{_i}", "exec"), _g)
        _res["passed"][_i] = True
    except BaseException as e:
        if not _res["error"]:
            _res["error"] = f"test {_i}: {type(e).__name__}: {e}"[:500]
    _save()
'''


@dataclass(frozen=True)
class SandboxResult:
    passed: list[bool]
    compiled: bool
    timed_out: bool = False
    error: str = ""
    stderr: str = field(default="", repr=False)

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


@dataclass(frozen=True)
class CommandResult:
    output: str  # stdout and stderr, interleaved as written, cut to the sandbox's output limit
    returncode: int | None  # None: killed at the timeout
    timed_out: bool = False


@lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    """The command prefix that gives a child its own (empty) network namespace, or () if none works."""
    exe = shutil.which("unshare")
    if not exe:
        return ()
    for prefix in ((exe, "-rn"), (exe, "-n")):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.SubprocessError):
            continue
    return ()


@dataclass(frozen=True)
class Sandbox:
    timeout_s: float = 5.0  # wall clock for the whole run
    cpu_s: int = 5
    memory_mb: int = 512
    file_mb: int = 16
    isolate_network: bool = True
    output_chars: int = 4000  # exec: output kept (the head)

    @property
    def network_isolation(self) -> str:
        if not self.isolate_network:
            return "none"
        return "namespace" if _unshare_prefix() else "socket-block"

    def _limits(self) -> None:  # runs in the child, before exec
        os.setsid()
        mem = self.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_mb * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    def exec(self, argv: list[str], cwd: str) -> CommandResult:
        """Run ``argv`` (no shell) in ``cwd`` with the limits, an empty environment and no network."""
        prefix = _unshare_prefix() if self.isolate_network else ()
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cwd}
        proc = subprocess.Popen([*prefix, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, preexec_fn=self._limits)
        try:
            out, _ = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, _ = proc.communicate()
            return CommandResult(out.decode(errors="replace")[: self.output_chars], None, True)
        return CommandResult(out.decode(errors="replace")[: self.output_chars], proc.returncode)

    def run(self, code: str, tests: list[str]) -> SandboxResult:
        with tempfile.TemporaryDirectory(prefix="af-sandbox-") as tmp:
            out = os.path.join(tmp, f".result-{uuid.uuid4().hex}.json")
            with open(os.path.join(tmp, "candidate.py"), "w") as f:
                f.write(code)
            with open(os.path.join(tmp, "tests.json"), "w") as f:
                json.dump(list(tests), f)
            with open(os.path.join(tmp, "harness.py"), "w") as f:
                f.write(_HARNESS)
            prefix = _unshare_prefix() if self.isolate_network else ()
            mode = "block" if self.isolate_network and not prefix else "open"
            cmd = [*prefix, sys.executable, "-I", "harness.py", out, str(len(tests)), mode]
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, preexec_fn=self._limits)
            timed_out = False
            try:
                _, err = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, err = proc.communicate()
            stderr = err.decode(errors="replace")[-2000:]
            try:
                with open(out) as f:
                    res = json.load(f)
            except (OSError, json.JSONDecodeError):
                return SandboxResult([False] * len(tests), False, timed_out, "no result (killed before start)", stderr)
            error = res["error"] or ("timed out" if timed_out else "") or (f"exit {proc.returncode}" if proc.returncode else "")
            return SandboxResult([bool(p) for p in res["passed"]], bool(res["compiled"]), timed_out, error, stderr)
