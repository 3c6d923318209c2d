"""The Node.js examples (``examples/node/``): node and npm, and their packages installed from the lock file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

NODE, NPM = shutil.which("node"), shutil.which("npm")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "node"


def installed() -> Path:
    """The example's directory with ``npm ci`` done (skips the test when node or npm is absent)."""
    if not NODE or not NPM:
        pytest.skip("node and npm are needed to run the Node.js examples (not installed here)")
    lock = (EXAMPLE / "package-lock.json").read_text()
    stamp = EXAMPLE / "node_modules" / ".astraflow-lock"
    if not stamp.exists() or stamp.read_text() != lock:
        cmd = [NPM, "ci", "--prefer-offline", "--cache", str(EXAMPLE / ".npm-cache"), "--no-audit", "--no-fund"]
        proc = subprocess.run(cmd, cwd=EXAMPLE, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, f"npm ci failed: {proc.stderr[-2000:]}"
        stamp.write_text(lock)
    return EXAMPLE
