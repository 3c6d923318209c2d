"""Shared fixtures: a real nats-server per test module, a unique run id per test."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.server import EmbeddedServer


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory):
    server = EmbeddedServer(tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


@pytest.fixture
def run_id() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
async def plane(nats_server: EmbeddedServer, run_id: str):
    p = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "test")
    await p.ensure_topology(Topology(policies=("solver",), task_ack_wait=2.0, traj_ack_wait=2.0))
    yield p
    await p.close()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
