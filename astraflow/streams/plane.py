"""The message plane: connect, ensure topology, typed publish / pull / ack, lag, DLQ, run state.

This module (with ``objects.py``) is the only place that talks to NATS. Roles get a
:class:`Plane` and see typed messages; malformed ones never reach them: they go to the
dead-letter stream with the reason and are terminated so they are not redelivered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import nats
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import BadRequestError, NotFoundError
from pydantic import BaseModel, ConfigDict

from astraflow.streams.codec import DecodeError, decode, encode
from astraflow.streams.messages import Message, Rejected
from astraflow.streams.subjects import Names

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)


class NatsOptions(BaseModel):
    """How to reach the server: an URL (or several, comma-separated) plus optional auth and TLS."""

    model_config = ConfigDict(extra="forbid")
    url: str = "nats://127.0.0.1:4222"
    user: str | None = None
    password: str | None = None
    creds: str | None = None  # path of a .creds file (JWT + nkey)
    nkey_seed: str | None = None  # path of an nkey seed file
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    domain: str | None = None  # JetStream domain (a leafnode region reads its own mirror)

    def connect_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"servers": [u.strip() for u in self.url.split(",")]}
        if self.user:
            kw["user"], kw["password"] = self.user, self.password
        if self.creds:
            kw["user_credentials"] = self.creds
        if self.nkey_seed:
            kw["nkeys_seed"] = self.nkey_seed
        if self.tls_ca or self.tls_cert:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            kw["tls"] = ctx
        return kw


@dataclass(frozen=True)
class Lag:
    """Consumer lag as the server reports it."""

    pending: int  # not yet delivered
    ack_pending: int  # delivered, not yet acked
    redelivered: int


@dataclass
class Delivery(Generic[M]):
    """A decoded message plus the handle to settle it. Every delivery is acked, nak'ed or termed on purpose."""

    msg: M
    raw: Msg

    @property
    def num_delivered(self) -> int:
        return self.raw.metadata.num_delivered

    async def ack(self) -> None:
        await self.raw.ack()

    async def nak(self, delay: float | None = None) -> None:
        await self.raw.nak(delay=delay)

    async def in_progress(self) -> None:
        await self.raw.in_progress()

    async def term(self) -> None:
        await self.raw.term()


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


class Plane:
    """A connection to the plane for one run."""

    def __init__(self, nc: nats.NATS, names: Names, worker_id: str, domain: str | None = None) -> None:
        self.nc = nc
        self.names = names
        self.worker_id = worker_id
        self.domain = domain
        self.js = nc.jetstream(domain=domain, timeout=10.0)
        self.jsm = nc.jsm(prefix=f"$JS.{domain}.API") if domain else nc.jsm()  # manage streams in that domain
        self.kv: Any = None

    @classmethod
    async def connect(cls, opts: NatsOptions, run: str, worker_id: str) -> "Plane":
        nc = await nats.connect(
            **opts.connect_kwargs(), name=f"astraflow:{run}:{worker_id}", max_reconnect_attempts=-1, reconnect_time_wait=0.5
        )
        return cls(nc, Names(run), worker_id, opts.domain)

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    async def close(self) -> None:
        """Flush what was published or acked, then close (no drain: open pull requests would stall it)."""
        if self.nc.is_closed:
            return
        try:
            await self.nc.flush(timeout=5)
        except Exception:
            pass
        await self.nc.close()

    # ---------------------------------------------------------------- topology
    async def _stream(self, cfg: api.StreamConfig) -> None:
        """Create the stream, or bring an existing one to ``cfg``; read-only when it already matches.

        Looking first means a role whose account may not create streams (a rollout node under
        ``jetstream/accounts.conf``) still starts, once an operator or the dataflow created them.
        """
        try:
            have = (await self.jsm.stream_info(cfg.name)).config
        except NotFoundError:
            await self.jsm.add_stream(cfg)
            return
        fields = ("subjects", "retention", "max_age", "max_msgs_per_subject", "num_replicas", "duplicate_window")
        wanted = {f: getattr(cfg, f) for f in fields if getattr(cfg, f) not in (None, 0)}  # 0 / None: server default
        if any(getattr(have, f) != v for f, v in wanted.items()):
            try:
                await self.jsm.update_stream(cfg)
            except BadRequestError as e:
                raise RuntimeError(f"stream {cfg.name} exists with an incompatible config ({e.description}); delete it or use another run id") from None

    async def _consumer(self, stream: str, cfg: api.ConsumerConfig) -> None:
        try:
            await self.jsm.consumer_info(stream, cfg.durable_name)
        except NotFoundError:
            await self.jsm.add_consumer(stream, cfg)

    async def ensure_topology(self, topo: Topology) -> None:
        n, dedup, r = self.names, topo.dedup_window, topo.replicas
        file = api.StorageType.FILE
        await self._stream(api.StreamConfig(name=n.task_stream, subjects=[n.all("task")], retention=api.RetentionPolicy.WORK_QUEUE, storage=file, num_replicas=r, duplicate_window=dedup))
        await self._stream(api.StreamConfig(name=n.traj_stream, subjects=[n.all("traj")], retention=api.RetentionPolicy.LIMITS, storage=file, max_age=topo.traj_max_age, num_replicas=r, duplicate_window=dedup))
        await self._stream(api.StreamConfig(name=n.batch_stream, subjects=[n.all("batch")], retention=api.RetentionPolicy.WORK_QUEUE, storage=file, num_replicas=r, duplicate_window=dedup))
        await self._stream(api.StreamConfig(name=n.weights_stream, subjects=[n.all("weights")], retention=api.RetentionPolicy.LIMITS, storage=file, max_msgs_per_subject=topo.weights_history, num_replicas=r, duplicate_window=dedup))
        await self._stream(api.StreamConfig(name=n.dlq_stream, subjects=[n.all("dlq")], retention=api.RetentionPolicy.LIMITS, storage=file, num_replicas=r, max_age=topo.traj_max_age))
        explicit = api.AckPolicy.EXPLICIT
        for pool in topo.pools:
            await self._consumer(n.task_stream, api.ConsumerConfig(durable_name=n.pool_consumer(pool), filter_subject=n.all("task"), ack_policy=explicit, ack_wait=topo.task_ack_wait, max_deliver=topo.max_deliver, max_ack_pending=100_000))
        await self._consumer(n.traj_stream, api.ConsumerConfig(durable_name=n.DATAFLOW_CONSUMER, filter_subject=n.all("traj"), ack_policy=explicit, ack_wait=topo.traj_ack_wait, max_deliver=-1, max_ack_pending=1_000_000))
        for policy in topo.policies:
            await self._consumer(n.batch_stream, api.ConsumerConfig(durable_name=n.trainer_consumer(policy), filter_subject=n.batch(policy), ack_policy=explicit, ack_wait=topo.batch_ack_wait, max_deliver=topo.max_deliver))
        try:
            self.kv = await self.js.key_value(n.state_bucket)
        except NotFoundError:
            self.kv = await self.js.create_key_value(api.KeyValueConfig(bucket=n.state_bucket, history=1, storage=file, replicas=r))
        try:
            await self.js.object_store(n.object_bucket)
        except NotFoundError:
            await self.js.create_object_store(n.object_bucket, api.ObjectStoreConfig(storage=file, replicas=r))

    # ---------------------------------------------------------------- publish
    async def publish(self, subject: str, msg: Message, msg_id: str | None = None) -> None:
        """Publish and wait for the server's ack; ``msg_id`` deduplicates retries server-side."""
        data = encode(msg, self.max_payload)
        await self.js.publish(subject, data, headers={"Nats-Msg-Id": msg_id} if msg_id else None)

    async def publish_many(self, items: list[tuple[str, Message, str | None]]) -> None:
        """Pipelined publish of several messages (``publish_async``), waiting for every ack."""
        futs = []
        for subject, msg, msg_id in items:
            data = encode(msg, self.max_payload)
            futs.append(await self.js.publish_async(subject, data, headers={"Nats-Msg-Id": msg_id} if msg_id else None))
        if futs:
            await asyncio.gather(*futs)

    async def reject(self, subject: str, payload: bytes, reason: str, headers: dict[str, str] | None = None) -> None:
        kind = subject.split(".")[2] if subject.count(".") >= 2 else "unknown"
        rej = Rejected(subject=subject, reason=reason[:2000], worker_id=self.worker_id, headers=dict(headers or {}), payload=payload)
        await self.js.publish(self.names.dlq(kind), encode(rej))
        log.warning("rejected message on %s: %s", subject, reason[:300])

    # ---------------------------------------------------------------- pull
    async def subscribe(self, stream: str, durable: str) -> Any:
        return await self.js.pull_subscribe_bind(durable=durable, stream=stream)

    async def pull(self, sub: Any, model: type[M], batch: int = 1, timeout: float = 1.0) -> list[Delivery[M]]:
        """Fetch up to ``batch`` messages; an empty list on timeout. Bad ones go to the DLQ."""
        try:
            raws = await sub.fetch(batch=batch, timeout=timeout)
        except (NatsTimeout, asyncio.TimeoutError):
            return []
        out: list[Delivery[M]] = []
        for raw in raws:
            try:
                out.append(Delivery(decode(raw.data, model), raw))
            except DecodeError as e:
                await self.reject(raw.subject, raw.data, str(e), raw.headers)
                await raw.term()
        return out

    async def lag(self, stream: str, durable: str) -> Lag:
        info = await self.jsm.consumer_info(stream, durable)
        return Lag(info.num_pending or 0, info.num_ack_pending or 0, info.num_redelivered or 0)

    async def last(self, stream: str, subject: str, model: type[M]) -> M | None:
        """The newest message on ``subject`` in ``stream``, decoded; None when there is none."""
        try:
            raw = await self.jsm.get_last_msg(stream, subject)
        except NotFoundError:
            return None
        return decode(raw.data or b"", model)

    async def get(self, stream: str, seq: int, model: type[M]) -> M:
        """The message at sequence ``seq`` of ``stream``, decoded (NotFoundError when it is gone)."""
        raw = await self.jsm.get_msg(stream, seq)
        return decode(raw.data or b"", model)

    async def ack_wait(self, stream: str, durable: str) -> float:
        """The consumer's ack_wait as the server has it (seconds)."""
        info = await self.jsm.consumer_info(stream, durable)
        return float(info.config.ack_wait or 30.0)

    async def stream_msgs(self, stream: str) -> int:
        info = await self.jsm.stream_info(stream)
        return info.state.messages

    # ---------------------------------------------------------------- run state (KV)
    async def _kv(self) -> Any:
        if self.kv is None:
            self.kv = await self.js.key_value(self.names.state_bucket)
        return self.kv

    async def state_put(self, key: str, value: Any) -> None:
        data = json.dumps(value).encode()
        if self.domain:  # nats-py puts on $KV.…, which is not forwarded across JetStream domains
            await self.js.publish(f"$JS.{self.domain}.API.$KV.{self.names.state_bucket}.{key}", data)
        else:
            await (await self._kv()).put(key, data)

    async def state_get(self, key: str, default: Any = None) -> Any:
        try:
            entry = await (await self._kv()).get(key)
        except Exception:  # KeyNotFoundError / KeyDeletedError
            return default
        return json.loads(entry.value) if entry.value else default

    # ---------------------------------------------------------------- heartbeats (core NATS)
    async def beat(self, hb: Message, role: str) -> None:
        await self.nc.publish(self.names.hb(role, self.worker_id), encode(hb))
