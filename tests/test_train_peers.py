"""The peer watch of a multi-rank trainer on a real c10d TCPStore, in one process: ranks that beat
are alive, a rank that stops beating is named after the timeout, an unreachable store silences all."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from astraflow.train.peers import PeerWatch, silent_peers

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 3.0  # generous: the machine running the tests may be busy


def test_silent_peers_are_those_quiet_for_longer_than_the_timeout():
    assert silent_peers({1: 10.0, 2: 4.0, 3: 5.0}, now=10.0, timeout=5.0) == [2]
    assert silent_peers({}, now=10.0, timeout=5.0) == []


@pytest.fixture
def store_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    yield port
    del server


class Lost:
    def __init__(self) -> None:
        self.why: list[str] = []
        self.event = threading.Event()

    def __call__(self, why: str) -> None:
        self.why.append(why)
        self.event.set()


def watch(rank: int, port: int, lost: Lost) -> PeerWatch:
    def connect(timeout_s: float) -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))

    return PeerWatch(rank, 3, TIMEOUT, connect=connect, on_lost=lost).start()


def test_a_rank_that_stops_beating_is_named_and_the_others_are_not(store_port):
    lost = [Lost() for _ in range(3)]
    watches = [watch(r, store_port, lost[r]) for r in range(3)]
    try:
        assert not lost[0].event.wait(2 * TIMEOUT)  # all three beat: nobody is silent
        watches[2].stop()  # rank 2 dies (its heartbeats stop)
        assert lost[0].event.wait(10 * TIMEOUT) and lost[1].event.wait(10 * TIMEOUT)
        assert "no heartbeat from rank(s) [2]" in lost[0].why[0] and "rank 0:" in lost[0].why[0]
        assert "rank(s) [2]" in lost[1].why[0]
        assert not lost[2].why
    finally:
        for w in watches:
            w.stop()


def test_an_unreachable_store_silences_every_peer():
    lost = Lost()

    def refuse(timeout_s: float) -> None:
        raise ConnectionRefusedError("the store's host is gone")

    w = PeerWatch(1, 2, TIMEOUT, connect=refuse, on_lost=lost).start()
    try:
        assert lost.event.wait(10 * TIMEOUT)
        assert "rank 1: no heartbeat from rank(s) [0]" in lost.why[0]
    finally:
        w.stop()
