"""The embedded nats-server: ready on a free port, stops cleanly, never outlives its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from astraflow.streams.server import EmbeddedServer


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_start_stop_and_store_in_run_dir(tmp_path):
    with EmbeddedServer(tmp_path) as s:
        assert s.url.startswith("nats://127.0.0.1:")
        pid = s.proc.pid
        assert (tmp_path / "nats" / "store").is_dir()
        assert "max_payload: 8388608" in (tmp_path / "nats" / "nats-server.conf").read_text()
    assert not _alive(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_when_parent_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from astraflow.streams.server import EmbeddedServer
        s = EmbeddedServer({str(tmp_path)!r}).start()
        print(s.proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "nats-server outlived its killed parent"
