"""What a live process has used so far, read from ``/proc`` (Linux)."""

from __future__ import annotations

import os
from pathlib import Path

CLK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK
