"""The shipped 3-node cluster config: a run's plane survives losing one node."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from astraflow.streams.messages import Task
from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.server import nats_server_binary

ROOT = Path(__file__).resolve().parent.parent


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    ports = free_ports(9)
    client, route, http = ports[:3], ports[3:6], ports[6:]
    procs = []
    for i in range(3):
        conf = (ROOT / "jetstream" / "cluster" / f"n{i + 1}.conf").read_text()
        conf = conf.replace("0.0.0.0", "127.0.0.1")
        conf = re.sub(r"listen: 127.0.0.1:\d+\nhttp: 127.0.0.1:\d+", f"listen: 127.0.0.1:{client[i]}\nhttp: 127.0.0.1:{http[i]}", conf)
        conf = re.sub(
            r"cluster \{\n  name: astraflow\n  listen: 127.0.0.1:\d+",
            f"cluster {{\n  name: astraflow\n  listen: 127.0.0.1:{route[i]}",
            conf,
        )
        conf = re.sub(r"routes: \[[^\]]*\]", "routes: [" + ", ".join(f"nats://127.0.0.1:{p}" for p in route) + "]", conf)
        conf = conf.replace(f'"./nats-n{i + 1}"', f'"{tmp / f"n{i + 1}"}"')
        path = tmp / f"n{i + 1}.conf"
        path.write_text(conf)
        procs.append(subprocess.Popen([nats_server_binary(), "-c", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    yield [f"nats://127.0.0.1:{p}" for p in client], procs
    for p in procs:
        p.terminate()
        p.wait(10)


def restart(procs: list[subprocess.Popen[bytes]], i: int) -> None:
    """Bring node i back with its own config and store (it rejoins the cluster and catches up)."""
    procs[i] = subprocess.Popen(procs[i].args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def connect_when_ready(url: str, run: str) -> Plane:
    deadline = time.monotonic() + 30
    while True:
        try:
            plane = await Plane.connect(NatsOptions(url=url), run, "t")
            await plane.ensure_topology(Topology(policies=("solver",), replicas=3, task_ack_wait=2))
            return plane
        except Exception:
            if time.monotonic() > deadline:
                raise
            await _sleep(0.5)


async def _sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


async def test_replicated_plane_survives_a_node_loss(cluster):
    urls, procs = cluster
    plane = await connect_when_ready(",".join(urls), "clu")
    info = await plane._jsm.stream_info(plane.names.task_stream)
    assert info.config.num_replicas == 3
    for i in range(5):
        await plane.publish(
            plane.names.task("math"),
            Task(task_id=f"k{i}", workflow="math", policy="solver", prompt_id="p", prompt="1+1", group_size=2),
            f"k{i}",
        )
    await plane.close()
    procs[0].kill()  # lose a node (maybe the leader)
    procs[0].wait()
    survivor = await connect_when_ready(",".join(urls[1:]), "clu")
    sub = survivor.consumer(survivor.names.task_stream, "raas", Task)
    got: list[str] = []
    deadline = time.monotonic() + 30
    while len(got) < 5 and time.monotonic() < deadline:
        for d in await sub.pull(batch=5, timeout=1):
            got.append(d.msg.task_id)
            await d.ack()
    assert sorted(got) == [f"k{i}" for i in range(5)]
    await survivor.close()
    restart(procs, 0)


@pytest.mark.slow
def test_a_run_under_up_rides_through_a_server_kill(cluster, repo_root, tmp_path):
    """`astraflow up --nats` on the 3-node cluster (replicas 3): one nats-server is killed mid-run; every role
    reconnects to the others and the run completes with every version announced exactly once."""
    import json
    import sys

    urls, procs = cluster
    run_dir = tmp_path / "on-cluster"
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(repo_root / "recipes" / "arithmetic"), "--nats", ",".join(urls),
           "--run-dir", str(run_dir), "--set", "plane.replicas=3", "--set", "trainer.steps=40", "--set", "sft.steps=100",
           "--set", "eval.every=40", "--set", "plane.task_ack_wait=5", "--timeout", "400"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 5:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read() if launcher.stderr else ""
        time.sleep(0.2)
    procs[1].kill()  # a node of the cluster goes away mid-run
    procs[1].wait()
    try:
        _, err = launcher.communicate(timeout=400)
    finally:
        restart(procs, 1)
    assert launcher.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["version"] for r in rows] == list(range(41))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["accounting"]["solver"]["adds_up"] and summary["outcome"] == "finished"
