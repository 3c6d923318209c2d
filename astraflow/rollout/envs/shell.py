"""A restricted shell over one scratch directory: an agent's command lines, run in the sandbox.

A command line is split like a POSIX shell would (``shlex``) and run without a shell:

- the program must be one of :data:`PROGRAMS` (file and text utilities; nothing that runs other
  programs, links files or reaches the network);
- every path stays inside the scratch directory: an argument (or an option's ``=value``) that is
  absolute, starts with ``~`` or has a ``..`` part is refused;
- ``*``, ``?`` and ``[...]`` are expanded inside the directory (sorted; no match: kept as written);
- one trailing ``> FILE`` or ``>> FILE`` writes the output to a file in the directory;
- pipes, ``;``, ``&&``, ``$(...)`` and variables are not interpreted (they reach the program as text).

The program runs in :class:`~astraflow.rollout.rewards.sandbox.Sandbox` (resource limits, a wall-clock
timeout, an empty environment, no network), with the scratch directory as its working directory.
A refused or failing command is an observation (its error text), never an exception.
"""

from __future__ import annotations

import glob
import shlex
import shutil
from pathlib import Path, PurePosixPath

from astraflow.rollout.rewards.sandbox import Sandbox

PROGRAMS = ("ls", "cat", "grep", "cp", "mv", "rm", "mkdir", "rmdir", "touch", "echo", "head", "tail", "wc", "sort", "uniq")
OUTPUT_CHARS = 400  # of a command's output shown to the agent
SEARCH_PATH = "/usr/bin:/bin"  # the sandbox's PATH


class Refused(ValueError):
    """A command line the restricted shell does not run; the message says why."""


def confined(arg: str) -> str:
    """``arg`` if it names nothing outside the working directory, else :class:`Refused`."""
    value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
    if value.startswith(("/", "~")) or ".." in PurePosixPath(value).parts:
        raise Refused(f"{arg}: only paths inside the working directory are allowed")
    return arg


def expand(arg: str, cwd: Path) -> list[str]:
    if arg.startswith("-") or not any(c in arg for c in "*?["):
        return [arg]
    found = sorted(str(Path(m).relative_to(cwd)) for m in glob.glob(str(cwd / arg)))
    return found or [arg]


def parse(line: str, cwd: Path) -> tuple[list[str], str | None, bool]:
    """(argv, file the output goes to, append) of a command line, paths checked and globs expanded."""
    try:
        words = shlex.split(line)
    except ValueError as e:
        raise Refused(f"syntax error: {e}") from None
    target, append = None, False
    if len(words) >= 2 and words[-2] in (">", ">>"):
        target, append = confined(words[-1]), words[-2] == ">>"
        words = words[:-2]
    if not words:
        raise Refused("empty command")
    if words[0] not in PROGRAMS:
        raise Refused(f"{words[0]}: command not found (available: {' '.join(PROGRAMS)})")
    if shutil.which(words[0], path=SEARCH_PATH) is None:
        raise Refused(f"{words[0]}: not installed")
    args = [a for w in words[1:] for a in expand(confined(w), cwd)]
    return [words[0], *args], target, append


def run_command(line: str, cwd: Path, sandbox: Sandbox) -> str:
    """Run one command line in ``cwd``; its output (or where it failed), at most :data:`OUTPUT_CHARS` characters."""
    try:
        argv, target, append = parse(line, cwd)
    except Refused as e:
        return f"error: {e}"
    result = sandbox.exec(argv, str(cwd))
    if result.timed_out:
        return f"error: timed out after {sandbox.timeout_s:g}s"
    out = result.output
    if target is not None and result.returncode == 0:
        path = cwd / target
        if path.is_dir():
            return f"error: {target}: is a directory"
        with open(path, "a" if append else "w") as f:
            f.write(out)
        out = ""
    return out[:OUTPUT_CHARS].rstrip("\n")
