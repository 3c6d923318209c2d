"""Emulated uplinks for benchmarks that put many servers on one machine.

On one machine every nats-server shares loopback and the cores, so a fan-out's time measures CPU more than links
(``bench_fanout.py`` without ``--link``). Here each server gets an uplink of its own: a paced TCP forwarder stands in
front of each of its listening ports, and everything the server sends out of any of them (to its clients, to the
servers that dial it) shares one :class:`Link` of ``rate`` bytes/s. What is sent to a server is not paced (it is the
sender's uplink that counts, and a node's requests are small).

A link sends a read when it would have finished sending what came before:

    leaves_at(read) = max(now, leaves_at(previous read)) + len(read) / rate

so the connections of one server share its rate in the order their reads arrive, and a server with N readers of one
object takes N times as long as with one. It is an emulation, labelled as such where its figures are shown; the
servers, their mirrors and the nodes' reads are real.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Sequence
from multiprocessing.sharedctypes import Synchronized

READ = 32 * 1024  # the most one paced read forwards at once


class Link:
    """One server's uplink, shared by every connection out of the server. ``rate()``: its bytes/s now (<= 0: not
    paced, as loopback)."""

    def __init__(self, rate: Callable[[], float]) -> None:
        self.rate = rate
        self.free_at = 0.0  # monotonic time at which the link has sent everything given to it so far

    def delay(self, size: int) -> float:
        """Seconds until ``size`` more bytes have left, queued behind what the link holds."""
        rate, now = self.rate(), time.monotonic()
        if rate <= 0:
            return 0.0
        self.free_at = max(self.free_at, now) + size / rate
        return self.free_at - now


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, link: Link | None) -> None:
    while data := await src.read(READ):
        if link is not None:
            await asyncio.sleep(link.delay(len(data)))
        dst.write(data)
        await dst.drain()


async def _forward(client: asyncio.StreamReader, to_client: asyncio.StreamWriter, port: int, link: Link) -> None:
    """One connection: the client's bytes to the server as they come, the server's through its link."""
    try:
        server, to_server = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        to_client.close()
        return
    pipes = [asyncio.ensure_future(_pipe(client, to_server, None)), asyncio.ensure_future(_pipe(server, to_client, link))]
    try:
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)  # either side closed: close both
    finally:
        for p in pipes:
            p.cancel()
        for w in (to_server, to_client):
            w.close()


async def serve(forwards: Sequence[tuple[int, int, str]], rate: Callable[[], float]) -> None:
    """Forward each ``(public port, server's port, server name)`` until cancelled, the ports of one name sharing one
    :class:`Link` of ``rate()`` bytes/s."""
    links = {name: Link(rate) for _, _, name in forwards}
    servers = []
    for public, port, name in forwards:
        async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter, port: int = port, link: Link = links[name]) -> None:
            await _forward(r, w, port, link)

        servers.append(await asyncio.start_server(on_connect, "127.0.0.1", public))
    await asyncio.gather(*(s.serve_forever() for s in servers))


def run(forwards: Sequence[tuple[int, int, str]], rate: Synchronized[float]) -> None:
    """A process's entry point: :func:`serve` forever, every link at ``rate.value`` bytes/s (its owner may change it)."""
    asyncio.run(serve(forwards, lambda: rate.value))


def wait_listening(ports: Sequence[int], timeout: float = 30.0) -> None:
    """Return once every port accepts a connection; raise ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    for port in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s") from None
                time.sleep(0.05)
