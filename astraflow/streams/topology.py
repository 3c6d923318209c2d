"""The run's topology on the server: which streams, consumers, buckets and object stores a run needs, made
idempotently (:class:`TopologyMaker`), or waited for by a role that may not make them.

:class:`~astraflow.streams.plane.Plane` owns one and exposes it as ``ensure_topology``, ``wait_for_topology`` and
``remake_consumer``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, JetStreamManager, api
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from astraflow.streams.objects import MAX_CONSUMERS, allow_consumers, object_stream
from astraflow.streams.subjects import Names

log = logging.getLogger(__name__)
NO_PEERS_FOR_PLACEMENT = 10005  # JetStream's error code for a replicated stream no set of peers can hold (yet)


@dataclass(frozen=True)
class Topology:
    """What a run needs on the server. ``ensure`` is idempotent: running it twice changes nothing."""

    policies: tuple[str, ...]
    pools: tuple[str, ...] = ("raas",)
    replicas: int = 1
    task_ack_wait: float = 60.0
    traj_ack_wait: float = 30.0
    batch_ack_wait: float = 300.0
    max_deliver: int = 20
    traj_max_age: float = 7 * 24 * 3600
    weights_history: int = 64
    dedup_window: float = 600.0
    fate_ttl: float = 24 * 3600
    max_consumers: int = MAX_CONSUMERS  # per stream (nats-server 2.15 allows 1,000 where none is named)


class TopologyMaker:
    """Makes a run's topology in one JetStream domain, and remembers the durable consumers it made so it can make
    them again when the server forgot them."""

    def __init__(self, js: JetStreamContext, jsm: JetStreamManager, names: Names) -> None:
        self._js, self._jsm, self.names = js, jsm, names
        self._consumers: dict[tuple[str, str], api.ConsumerConfig] = {}

    async def ensure(self, topo: Topology, create: bool = True, wait: float = 60.0) -> None:
        """Create what the run needs (idempotent), or with ``create=False`` wait until it exists. A server
        that is up but whose JetStream is not ready yet (a cluster electing leaders) is waited for, up to ``wait``."""
        if not create:
            await self.wait_for(topo)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            try:
                await self._create(topo)
                return
            except (ServiceUnavailableError, NoRespondersError, NatsTimeoutError, BadRequestError) as e:
                if isinstance(e, BadRequestError) and e.err_code != NO_PEERS_FOR_PLACEMENT:
                    raise  # a request the server refuses: waiting changes nothing (a peer not current yet does)
                why = e.description if isinstance(e, BadRequestError) else type(e).__name__
                if loop.time() > deadline:
                    raise ConnectionError(f"JetStream did not become available in {wait:.0f}s: {why}") from None
                log.warning("JetStream not ready (%s): retrying", why)
                await asyncio.sleep(1.0)

    async def wait_for(self, topo: Topology, note_every: float = 10.0) -> None:
        """For roles that may not create the run's streams: wait until whoever does (the dataflow,
        ``astraflow up``) has made them, saying so now and then."""
        n = self.names
        loop = asyncio.get_running_loop()
        start = last = loop.time()
        needed: list[tuple[str, str | None]] = [(n.stream(f), None) for f in ("task", "traj", "batch", "weights", "dlq")]
        needed += [(n.task_stream, n.pool_consumer(p)) for p in topo.pools] + [
            (n.batch_stream, n.trainer_consumer(p)) for p in topo.policies
        ]
        needed += [(object_stream(n.traj_object_bucket), None)]
        while True:
            missing = []
            for stream, durable in needed:
                try:
                    await (self._jsm.consumer_info(stream, durable) if durable else self._jsm.stream_info(stream))
                except NotFoundError:
                    missing.append(f"{stream}/{durable}" if durable else stream)
                except Exception as e:  # no JetStream answering yet (a hub behind a leaf that is still linking): wait too
                    missing.append(f"{stream} ({type(e).__name__})")
            if not missing:
                return
            if loop.time() - last >= note_every or last == start:
                log.warning("waiting for the run's streams (%s missing): start the dataflow or `astraflow up` for run %s",
                            ", ".join(missing[:3]), n.run)
                last = loop.time() + 1e-3
            await asyncio.sleep(1.0)

    async def remake_consumer(self, stream: str, durable: str) -> bool:
        """Make a durable consumer this topology made before again if the server forgot it (a restart without its
        store); whether it did. False: the consumer is there, or this role did not make it (it may not)."""
        cfg = self._consumers.get((stream, durable))
        if cfg is None:
            return False
        try:
            await self._jsm.consumer_info(stream, durable)
            return False
        except NotFoundError:
            log.warning("consumer %s on %s is gone from the server: creating it again", durable, stream)
            await self._jsm.add_consumer(stream, cfg)
            return True

    async def _stream(self, cfg: api.StreamConfig) -> None:
        """Create the stream, or bring an existing one to ``cfg``; read-only when it already matches.

        Looking first means a role whose account may not create streams (a rollout node under
        ``jetstream/accounts.conf``) still starts, once an operator or the dataflow created them.
        """
        assert cfg.name is not None
        try:
            have = (await self._jsm.stream_info(cfg.name)).config
        except NotFoundError:
            await self._jsm.add_stream(cfg)
            return
        fields = ("subjects", "retention", "max_age", "max_msgs_per_subject", "num_replicas", "duplicate_window", "allow_direct",
                  "max_consumers")
        wanted = {f: getattr(cfg, f) for f in fields if getattr(cfg, f) not in (None, 0)}  # 0 / None: server default
        if any(getattr(have, f) != v for f, v in wanted.items()):
            try:
                await self._jsm.update_stream(cfg)
            except BadRequestError as e:
                raise RuntimeError(f"stream {cfg.name} exists with an incompatible config ({e.description}); "
                                   "delete it or use another run id") from None

    async def _consumer(self, stream: str, cfg: api.ConsumerConfig) -> None:
        assert cfg.durable_name is not None
        self._consumers[(stream, cfg.durable_name)] = cfg
        try:
            await self._jsm.consumer_info(stream, cfg.durable_name)
        except NotFoundError:
            await self._jsm.add_consumer(stream, cfg)

    async def _bucket(self, name: str, cfg: api.KeyValueConfig) -> None:
        try:
            await self._js.key_value(name)
        except NotFoundError:
            await self._js.create_key_value(cfg)

    async def _create(self, topo: Topology) -> None:
        n, dedup, r = self.names, topo.dedup_window, topo.replicas
        file, limits, work = api.StorageType.FILE, api.RetentionPolicy.LIMITS, api.RetentionPolicy.WORK_QUEUE
        def stream(family: str, retention: api.RetentionPolicy, dedup: float = dedup, max_age: float | None = None,
                   per_subject: int = -1, direct: bool = False, also: tuple[str, ...] = ()) -> api.StreamConfig:
            return api.StreamConfig(name=n.stream(family), subjects=[n.all(family), *also], retention=retention, storage=file,
                                    num_replicas=r, duplicate_window=dedup, max_age=max_age, max_msgs_per_subject=per_subject,
                                    allow_direct=direct or None, max_consumers=topo.max_consumers)

        # TRAJ allows direct gets: trainers read their batches' trajectories by sequence (streams/direct.py). DLQ also keeps
        # the server's max-deliveries advisories of the pools' consumers: a task nobody could serve is a dead letter too, and
        # kept, a dataflow that was down when the server gave up on it still learns of it (``dataflow/watch.py``)
        dead_tasks = (n.max_deliveries_advisory(n.task_stream, "*"),)  # every pool's
        for cfg in (stream("task", work), stream("traj", limits, max_age=topo.traj_max_age, direct=True), stream("batch", work),
                    stream("weights", limits, per_subject=topo.weights_history),
                    stream("dlq", limits, 0, max_age=topo.traj_max_age, also=dead_tasks)):
            await self._stream(cfg)
        explicit = api.AckPolicy.EXPLICIT
        for pool in topo.pools:
            await self._consumer(n.task_stream, api.ConsumerConfig(
                durable_name=n.pool_consumer(pool), filter_subject=n.all("task"), ack_policy=explicit, ack_wait=topo.task_ack_wait,
                max_deliver=topo.max_deliver, max_ack_pending=100_000))
        await self._consumer(n.traj_stream, api.ConsumerConfig(
            durable_name=n.DATAFLOW_CONSUMER, filter_subject=n.all("traj"), ack_policy=explicit, ack_wait=topo.traj_ack_wait,
            max_deliver=-1, max_ack_pending=1_000_000))
        for policy in topo.policies:
            await self._consumer(n.batch_stream, api.ConsumerConfig(
                durable_name=n.trainer_consumer(policy), filter_subject=n.batch(policy), ack_policy=explicit,
                ack_wait=topo.batch_ack_wait, max_deliver=topo.max_deliver))
        await self._bucket(n.state_bucket, api.KeyValueConfig(bucket=n.state_bucket, history=1, storage=file, replicas=r))
        await self._bucket(n.fates_bucket, api.KeyValueConfig(bucket=n.fates_bucket, history=1, storage=file, replicas=r,
                                                              ttl=topo.fate_ttl))
        try:
            await self._js.object_store(n.object_bucket)
        except NotFoundError:
            await self._js.create_object_store(n.object_bucket, api.ObjectStoreConfig(storage=file, replicas=r))
        try:  # trajectory arrays live as long as the trajectories that name them (the TRAJ stream's max age)
            await self._js.object_store(n.traj_object_bucket)
        except NotFoundError:
            await self._js.create_object_store(n.traj_object_bucket, api.ObjectStoreConfig(storage=file, replicas=r,
                                                                                           ttl=topo.traj_max_age))
        for bucket in (n.object_bucket, n.traj_object_bucket):  # a node streams a many-chunk payload through a consumer
            await allow_consumers(self._jsm, object_stream(bucket), topo.max_consumers)
