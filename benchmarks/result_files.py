"""Where a benchmark's figures go: ``benchmarks/results/<name>.json``, with what made them.

``write(name, figures)`` records the figures with the command line, the machine (cores, CPU model,
memory, load average when it started), the date and the commit (``+dirty`` when the tree had
changes other than the benchmarks' own outputs). ``benchmarks/render.py`` renders BENCHMARKS.md's
sections from these files, so the page shows what was run, not what someone copied.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LOAD_AT_START = os.getloadavg()[0]


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cores = len(os.sched_getaffinity(0))
    cores_text = f"{cores} cores" if cores == os.cpu_count() else f"{cores} of {os.cpu_count()} cores (taskset)"
    return f"{cores_text} ({model}), {memory:.0f} GiB, load {LOAD_AT_START:.1f} at start"


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    outputs = [":!benchmarks/results", ":!benchmarks/figures", ":!BENCHMARKS.md"]  # what benchmarks write, not what they run
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".", *outputs) else "")


def write(name: str, figures: dict[str, Any], path: str | Path | None = None) -> Path:
    """Record ``figures`` as ``benchmarks/results/<name>.json`` (or ``path``) with their provenance."""
    out = Path(path) if path else RESULTS / f"{name}.json"
    record = {"benchmark": name, "command": shlex.join(["python", *[Path(sys.argv[0]).as_posix().split(str(ROOT) + "/")[-1]],
                                                       *sys.argv[1:]]),
              "machine": machine(), "date": datetime.date.today().isoformat(), "commit": commit(), **figures}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return out
