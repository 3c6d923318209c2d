"""Regions: the shipped hub + leaf configs on two real nats-servers (loopback), JetStream domains,
mirrors of the weights bucket and announcements on the leaf, and a RaaS node connected only to
the leaf that applies versions published on the hub."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError
from weights_helpers import WIDE, Trainer, engine_digest, node

from astraflow.streams.objects import chunk_subject, count_chunks, ensure_region_mirrors, object_stream
from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.server import EmbeddedServer, free_port, nats_server_binary, start_region_pair, start_relay
from astraflow.streams.state import KeyframeRequest, VersionRecord
from astraflow.weights.publish import WeightPublisher, request_keyframe

CONF = Path(__file__).resolve().parent.parent / "jetstream"


@pytest.fixture(scope="module")
def region(tmp_path_factory: pytest.TempPathFactory):
    hub, leaf = start_region_pair(CONF, tmp_path_factory.mktemp("region"))
    yield hub, leaf
    leaf.stop()
    hub.stop()


@pytest.fixture
async def planes(region):
    """(trainer's plane on the hub, a RaaS node's plane on the leaf whose run traffic goes to the hub domain)."""
    hub, leaf = region
    run = "r" + uuid.uuid4().hex[:10]
    trainer = await Plane.connect(NatsOptions(url=hub.url), run, "trainer")
    await trainer.ensure_topology(Topology(policies=("solver",)))
    remote = await Plane.connect(NatsOptions(url=leaf.url, domain="hub"), run, "raas-eu")
    await remote.wait_for_domain("hub")
    yield trainer, remote
    await remote.close()
    await trainer.close()


@pytest.mark.parametrize("name", ["hub.conf", "leaf.conf", "relay.conf"])
def test_shipped_region_configs_are_valid(name: str):
    res = subprocess.run([nats_server_binary(), "-t", "-c", str(CONF / name)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr + res.stdout
    text = (CONF / name).read_text()
    assert f"domain: {name.split('.')[0]}" in text and "leafnodes" in text


async def test_node_on_the_leaf_applies_versions_published_on_the_hub(planes):
    trainer_plane, remote = planes
    run = remote.names.run
    streams = await ensure_region_mirrors(remote, run, hub_domain="hub")
    assert await ensure_region_mirrors(remote, run, hub_domain="hub") == streams  # idempotent
    leaf_js = remote._nc.jetstream(domain="leaf")
    info = await leaf_js.stream_info(streams.object_stream)
    assert info.config.mirror.name == object_stream(remote.names.object_bucket) and info.config.mirror.external.api == "$JS.hub.API"

    trainer = Trainer()
    pub = WeightPublisher(trainer_plane, "solver", keyframe_every=3, keep_versions=2, mirror_domains=("leaf",))
    sync = node(remote, domain="leaf")
    anns = []
    for v in range(8):  # keyframes 0, 3, 6
        anns.append(await pub.publish(trainer.step() if v else trainer.model.state_dict(), v))
        await sync.wait_for(v, timeout=20)
        assert sync.version == v and engine_digest(sync) == anns[-1].state_digest
    assert sync.stats["keyframes"] == 3 and sync.stats["deltas"] == 5 and sync.stats["failures"] == 0

    # retention ran on the hub and on the leaf's mirror alike: v0..v5 are gone from both
    await pub.keeper.wait()
    bucket = remote.names.object_bucket
    for js in (trainer_plane._js, leaf_js):
        counts = [await count_chunks(js, object_stream(bucket), chunk_subject(bucket, a.objects[0].nuid)) for a in anns]
        assert counts == [0] * 6 + [1] * 2

    # the node reads the leaf's mirror, not the hub: with the hub's copy gone, a late joiner on the leaf still syncs
    for a in anns[6:]:
        await trainer_plane._js.purge_stream(object_stream(bucket), subject=chunk_subject(bucket, a.objects[0].nuid))
    late = node(remote, domain="leaf")
    await late.wait_for(7, timeout=20)
    assert engine_digest(late) == trainer.digest and late.stats["joins"] == 1
    on_hub = node(remote)  # same node reading the hub instead: the objects are gone there
    assert not await on_hub.refresh(wait=2.0) and on_hub.stats["missing"] > 0


async def test_nodes_on_relays_apply_versions_through_their_mirrors_and_retention_reaches_them(tmp_path):
    """The shipped relay (a leaf of the region's leaf) mirrors the region's mirrors, and a relay below it (relays of
    relays) mirrors its mirrors: a node connected only to either keeps the run's traffic on the hub and applies every
    version from its own server's mirror; the trainer's retention deletes on both relays too (the hub reaches their
    domains through the leaf)."""
    port, below = free_port(), free_port()
    hub, leaf = start_region_pair(CONF, tmp_path, relay_port=port)
    relay = start_relay(CONF, tmp_path, port, below_port=below)
    relay2 = start_relay(CONF, tmp_path, below, name="relay2")
    run = "rly" + uuid.uuid4().hex[:6]
    planes: list[Plane] = []
    try:
        trainer_plane = await Plane.connect(NatsOptions(url=hub.url), run, "trainer")
        await trainer_plane.ensure_topology(Topology(policies=("solver",)))
        for server, source in ((leaf, "hub"), (relay, "leaf"), (relay2, "relay")):
            planes.append(await Plane.connect(NatsOptions(url=server.url, domain="hub"), run, f"raas-{source}"))
            await planes[-1].wait_for_domain(source)
            await ensure_region_mirrors(planes[-1], run, hub_domain=source)
        on_relay, on_relay2 = planes[-2:]
        trainer = Trainer()
        pub = WeightPublisher(trainer_plane, "solver", keyframe_every=2, keep_versions=2, mirror_domains=("leaf", "relay", "relay2"))
        syncs = [node(on_relay, domain="relay"), node(on_relay2, domain="relay2")]
        anns = []
        for v in range(5):  # keyframes 0, 2, 4
            anns.append(await pub.publish(trainer.step() if v else trainer.model.state_dict(), v))
            for sync in syncs:
                await sync.wait_for(v, timeout=30)
                assert engine_digest(sync) == anns[-1].state_digest
        assert await on_relay2.state.get(VersionRecord, "solver") is not None  # the run's state, on the hub, two relays down
        await pub.keeper.wait()
        bucket = on_relay.names.object_bucket
        counts = [[await count_chunks(js, object_stream(bucket), chunk_subject(bucket, a.objects[0].nuid)) for a in anns]
                  for js in (trainer_plane._js, on_relay._nc.jetstream(domain="relay"), on_relay2._nc.jetstream(domain="relay2"))]
        assert counts[0] == counts[1] == counts[2] == [0, 0, 1, 1, 1]  # v3 needs keyframe v2: both kept, everywhere
    finally:
        for p in planes:
            await p.close()
        for s in (relay2, relay, leaf, hub):
            s.stop()


async def test_payloads_of_many_chunks_stream_through_the_mirror(planes):
    """Keyframe and deltas of several chunks, applied on the leaf while they are read from its mirror (which
    may still be catching up with the announcement)."""
    trainer_plane, remote = planes
    await ensure_region_mirrors(remote, remote.names.run, hub_domain="hub")
    trainer = Trainer(lr=1e-3, **WIDE)
    pub = WeightPublisher(trainer_plane, "solver", keyframe_every=100, max_delta_fraction=1.0, mirror_domains=("leaf",))
    sync = node(remote, WIDE, domain="leaf")
    for v in range(3):
        ann = await pub.publish(trainer.step() if v else trainer.model.state_dict(), v)
        assert len(ann.objects[0].digests) >= 2
        await sync.wait_for(v, timeout=30)
        assert engine_digest(sync) == ann.state_digest
    assert (sync.stats["keyframes"], sync.stats["deltas"], sync.stats["refetches"], sync.stats["failures"]) == (1, 2, 0, 0)


async def test_keyframe_request_from_the_leaf_reaches_the_hub_trainer(planes):
    trainer_plane, remote = planes
    trainer = Trainer()
    pub = WeightPublisher(trainer_plane, "solver", keyframe_every=100)
    await pub.publish(trainer.model.state_dict(), 0)
    assert (await pub.publish(trainer.step(), 1)).encoding == "delta"
    await request_keyframe(remote, "solver", "region eu lost its chain")
    assert (await trainer_plane.state.get(KeyframeRequest, "solver")).by == "raas-eu"
    assert (await pub.publish(trainer.step(), 2)).encoding == "keyframe"


async def test_mirror_over_an_existing_plain_stream_is_refused(planes):
    _, remote = planes
    leaf_jsm = remote._nc.jsm()
    name = remote.names.weights_stream
    with pytest.raises(NotFoundError):
        await leaf_jsm.stream_info(name)
    await leaf_jsm.add_stream(name=name, subjects=[f"local.{remote.names.run}.x"])
    with pytest.raises(RuntimeError, match="not a mirror"):
        await ensure_region_mirrors(remote, remote.names.run, hub_domain="hub")


async def test_run_state_read_and_written_from_the_leaf(planes):
    trainer_plane, remote = planes
    await remote.ensure_topology(Topology(policies=("solver",)))  # read-only: lands in the hub domain
    await remote.state.put(KeyframeRequest(policy="solver", by="raas-eu", reason="probe"))
    assert (await trainer_plane.state.get(KeyframeRequest, "solver")).reason == "probe"
    await trainer_plane.state.put(VersionRecord(policy="solver", version=7))
    assert (await remote.state.get(VersionRecord, "solver")).version == 7
    leaf_only = remote._nc.jsm(prefix="$JS.leaf.API")
    with pytest.raises(NotFoundError):
        await leaf_only.stream_info(remote.names.task_stream)  # nothing of the run was created on the leaf


async def test_a_node_on_the_leaf_rides_through_the_leaf_restarting(tmp_path):
    """The leaf region goes down and comes back on the same address: the node reconnects, its weight
    follower is remade from where it stopped, and it reaches the versions published meanwhile."""
    hub, leaf = start_region_pair(CONF, tmp_path)
    run = "ride" + uuid.uuid4().hex[:6]
    try:
        trainer_plane = await Plane.connect(NatsOptions(url=hub.url), run, "trainer")
        await trainer_plane.ensure_topology(Topology(policies=("solver",)))
        remote = await Plane.connect(NatsOptions(url=leaf.url, domain="hub"), run, "raas-eu")
        await remote.wait_for_domain("hub")
        await ensure_region_mirrors(remote, run, hub_domain="hub")
        trainer = Trainer()
        pub = WeightPublisher(trainer_plane, "solver", keyframe_every=4)
        sync = node(remote, domain="leaf")
        for v in range(3):
            await pub.publish(trainer.step() if v else trainer.model.state_dict(), v)
        await sync.wait_for(2, timeout=30)
        port = leaf.port
        leaf.stop()
        assert remote.disconnected_for() >= 0
        await pub.publish(trainer.step(), 3)  # published while the region is down
        leaf = EmbeddedServer(tmp_path / "leaf", config_text=leaf.config_text.replace("127.0.0.1:-1", f"127.0.0.1:{port}")).start()
        await pub.publish(trainer.step(), 4)
        await sync.wait_for(4, timeout=90)  # every refresh until then rides on the reconnected client
        assert engine_digest(sync) == trainer.digest and sync.stats["failures"] == 0
        assert remote.disconnected_for() == 0
        await remote.close()
        await trainer_plane.close()
    finally:
        leaf.stop()
        hub.stop()


def test_region_mirrors_command(region):
    """`astraflow region mirrors` makes the leaf's mirrors of a run (idempotently), as an operator runs it."""
    import sys

    _hub, leaf = region
    run = "cmd" + uuid.uuid4().hex[:6]
    cmd = [sys.executable, "-m", "astraflow.cli", "region", "mirrors", "--nats", leaf.url, "--run", run, "--hub-domain", "hub"]
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and f"AF_{run}_WEIGHTS" in proc.stdout, proc.stderr[-2000:]
    bad = subprocess.run([*cmd[:-1], "nowhere", "--timeout", "2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "nowhere" in bad.stderr
