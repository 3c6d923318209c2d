"""The message plane: connect, ensure topology, typed publish / consume / follow, lag, DLQ, run state.

This package is the only place that talks to NATS, and :class:`Plane` is its whole surface: roles
get typed messages, typed deliveries to settle, typed run-state records and object stores, and
never a NATS object. Malformed messages never reach them: from a work stream they go to the
dead-letter stream with the reason and are terminated so they are not redelivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import AuthorizationError, NoRespondersError
from nats.js import JetStreamContext, JetStreamManager, api
from nats.js.errors import APIError, NoStreamResponseError
from pydantic import BaseModel, ConfigDict

from astraflow.streams.acks import AcksLost, acked, reconnects_of
from astraflow.streams.codec import DecodeError, MessageTooLarge, decode, encode
from astraflow.streams.consuming import (
    Check,
    Consumer,
    ConsumerSettings,
    Delivery,
    Follower,
    Lag,
    OnBad,
    Subscription,
    log_bad,
    read_history,
)
from astraflow.streams.credentials import Credential, redact
from astraflow.streams.kv import RunState
from astraflow.streams.messages import Heartbeat, Message, Rejected
from astraflow.streams.objects import ObjectStore, object_stream
from astraflow.streams.permissions import inbox_prefix, node_of
from astraflow.streams.retry import ask_again
from astraflow.streams.stored import StoredMessages
from astraflow.streams.subjects import Names
from astraflow.streams.topology import Topology, TopologyMaker

log = logging.getLogger(__name__)
PUBLISH_ACK_TIMEOUT_S = 10.0  # how long a pipelined publication waits for the server's acks
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a publish whose expected last subject sequence is not the last


def refused_credential(e: BaseException) -> bool:
    """Whether a connection attempt failed because the server refused the credential. nats-py types the refusal
    (``AuthorizationError``) once connected; during the handshake it raises the server's ``-ERR`` line, which in
    the NATS protocol carries no code: its fixed text is the only signal there."""
    return isinstance(e, AuthorizationError) or "'authorization violation'" in str(e).lower()
M = TypeVar("M", bound=Message)
Oversize = Callable[[Message], Awaitable[Message]]  # a message too large to publish -> the one to publish instead
__all__ = ["Consumer", "ConsumerSettings", "Delivery", "Follower", "Lag", "NatsOptions", "Plane", "PublishConflict", "PublishRefused",
           "Subscription", "Topology"]


class PublishRefused(RuntimeError):
    """The server answered a publish with an error: the message is not in the stream. (A publish that raised anything
    else, a timeout or a lost connection, may have landed.)"""


class PublishConflict(PublishRefused):
    """A publish expected to follow a given message on its subject, and someone else published there first."""


class NatsOptions(BaseModel):
    """How to reach the server: an URL (or several, comma-separated) plus optional auth and TLS.

    ``credential``: a file written by ``astraflow up`` (user, password, run, URL, CA) — the way
    to join a run without a secret on the command line. A ``user`` without a ``password`` takes
    it from ``$NATS_PASSWORD``. Authenticated clients use their own inbox prefix
    (``_INBOX_{user}``), the only reply subjects the per-role permissions let them read.
    """

    model_config = ConfigDict(extra="forbid")
    url: str = "nats://127.0.0.1:4222"
    user: str | None = None
    password: str | None = None
    credential: str | None = None  # path of an astraflow credential file (``RUN_DIR/credentials/ROLE.json``)
    creds: str | None = None  # path of a .creds file (JWT + nkey)
    nkey_seed: str | None = None  # path of an nkey seed file
    tls_ca: str | None = None
    tls_ca_pem: str | None = None  # the CA itself (from a credential file)
    tls_cert: str | None = None
    tls_key: str | None = None
    domain: str | None = None  # JetStream domain (a leafnode region reads its own mirror)

    @classmethod
    def from_credential(cls, path: str, url: str | None = None, **kw: Any) -> NatsOptions:
        cred = Credential.read(path)
        return cls(url=url or cred.url, user=cred.user, password=cred.password, credential=path, tls_ca_pem=cred.tls_ca_pem, **kw)

    @property
    def run(self) -> str | None:
        """The run id a credential file names (None without one)."""
        return Credential.read(self.credential).run if self.credential else None

    def redacted(self) -> str:
        return redact(self.url)

    def connect_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"servers": [u.strip() for u in self.url.split(",")]}
        user = self.user or urlsplit(kw["servers"][0]).username
        if self.user:
            kw["user"], kw["password"] = self.user, self.password if self.password is not None else os.environ.get("NATS_PASSWORD")
        if user:
            kw["inbox_prefix"] = inbox_prefix(user)
        if self.creds:
            kw["user_credentials"] = self.creds
        if self.nkey_seed:
            kw["nkeys_seed"] = self.nkey_seed
        if self.tls_ca or self.tls_ca_pem or self.tls_cert:
            ctx = ssl.create_default_context(cafile=self.tls_ca, cadata=self.tls_ca_pem)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            kw["tls"] = ctx
        return kw


class _Gone:
    """When the connection went down (nats-py callbacks), so a role can bound how long it waits for its server; and
    the followers to resume when it is back (a restarted server has lost their consumers)."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.followers: weakref.WeakSet[Follower[Any]] = weakref.WeakSet()
        self._resuming: set[asyncio.Task[None]] = set()

    async def down(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    async def up(self) -> None:
        self.since = None
        for follower in list(self.followers):  # in tasks: the client is still finishing its reconnect in this callback
            task = asyncio.create_task(follower.resume())
            self._resuming.add(task)
            task.add_done_callback(self._resuming.discard)

    async def error(self, e: Exception) -> None:
        log.debug("nats: %s", e)

    def seconds(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since


async def connect_nats(opts: NatsOptions, name: str, wait: float | None) -> tuple[Client, _Gone]:
    """A client connection named ``name`` (:meth:`Plane.connect`), and the record of its outages; from then on it rides
    through server restarts."""
    kw = {**opts.connect_kwargs(), "name": name, "connect_timeout": 2.0}
    loop = asyncio.get_running_loop()
    start = last_note = loop.time()
    gone = _Gone()
    while True:
        try:  # the first connection without client-side retries: we decide here what is worth waiting for
            nc = await nats.connect(**kw, allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0.2,
                                    disconnected_cb=gone.down, reconnected_cb=gone.up, error_cb=gone.error)
            break
        except Exception as e:  # nats-py raises OSError, TimeoutError or its own errors, by cause
            if refused_credential(e):
                raise PermissionError(f"nats-server at {opts.redacted()} refused {opts.user or 'this client'}: authorization "
                                      "violation (wrong or stale credential?)") from None
            waited = loop.time() - start
            if wait is not None and waited >= wait:
                raise ConnectionError(f"no nats-server at {opts.redacted()} after {waited:.0f}s: {type(e).__name__}: {e}") from None
            if loop.time() - last_note >= 10 or waited == 0:
                log.warning("waiting for nats-server at %s (%s); retrying", opts.redacted(), type(e).__name__)
                last_note = loop.time()
            await asyncio.sleep(0.5)
    nc.options["allow_reconnect"] = True  # from now on, ride through server restarts
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = 0.5
    return nc, gone


class Plane:
    """A connection to the plane for one run."""

    def __init__(self, nc: Client, names: Names, worker_id: str, domain: str | None = None) -> None:
        self._nc = nc
        self.names = names
        self.worker_id = worker_id
        self.domain = domain
        self._js = nc.jetstream(domain=domain, timeout=10.0)
        self._jsm = self._jsm_for(domain)  # manage streams in that domain
        self._js_by_domain: dict[str | None, JetStreamContext] = {domain: self._js}
        self._topology = TopologyMaker(self._js, self._jsm, names)
        self.state = RunState(self._js, names, domain)
        self.stored = StoredMessages(nc, self._jsm, self.api_prefix)  # what the streams hold, by sequence; consumers' state
        self._gone = _Gone()
        self.node: str | None = None  # the node this connection's credential is (``node-NAME``): its trajectories' subject
        self.options: NatsOptions | None = None  # how this connection was made (``connect``): another process of the role connects alike

    @classmethod
    async def connect(cls, opts: NatsOptions, run: str, worker_id: str, wait: float | None = None) -> Plane:
        """Connect, waiting up to ``wait`` seconds (None: as long as it takes) for a server that is not
        there yet, with a log line now and then; a refused credential fails at once."""
        nc, gone = await connect_nats(opts, f"astraflow:{run}:{worker_id}", wait)
        plane = cls(nc, Names(run), worker_id, opts.domain)
        plane._gone = gone
        plane.node = node_of(opts.user)
        plane.options = opts
        return plane

    def disconnected_for(self) -> float:
        """Seconds since the connection to the server was lost (0 while connected)."""
        return self._gone.seconds()

    @property
    def api_prefix(self) -> str:
        """The JetStream API's subject prefix in this plane's domain."""
        return f"$JS.{self.domain}.API" if self.domain else "$JS.API"

    @property
    def max_payload(self) -> int:
        return int(self._nc.max_payload)

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)

    async def close(self) -> None:
        """Flush what was published or acked, then close (no drain: open pull requests would stall it).
        Without a server there is nothing to flush to: close at once."""
        if self._nc.is_closed:
            return
        if self._nc.is_connected:
            try:
                await self._nc.flush(timeout=5)
            except Exception:  # closing anyway
                pass
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._nc.close(), 5)

    def _jsm_for(self, domain: str | None) -> JetStreamManager:
        return self._nc.jsm(prefix=f"$JS.{domain}.API") if domain else self._nc.jsm()

    def _js_for(self, domain: str | None) -> JetStreamContext:
        if domain not in self._js_by_domain:
            self._js_by_domain[domain] = self._nc.jetstream(domain=domain, timeout=10.0)
        return self._js_by_domain[domain]

    # ---------------------------------------------------------------- topology
    async def ensure_topology(self, topo: Topology, create: bool = True, wait: float = 60.0) -> None:
        """Create what the run needs (idempotent), or with ``create=False`` wait until it exists. A server
        that is up but whose JetStream is not ready yet (a cluster electing leaders) is waited for, up to ``wait``."""
        await self._topology.ensure(topo, create, wait)
        self.state.forget()

    async def wait_for_topology(self, topo: Topology, note_every: float = 10.0) -> None:
        """For roles that may not create the run's streams: wait until whoever does (the dataflow,
        ``astraflow up``) has made them, saying so now and then."""
        await self._topology.wait_for(topo, note_every)
        self.state.forget()

    async def remake_consumer(self, stream: str, durable: str) -> bool:
        """Make a durable consumer this plane's topology made again if the server forgot it; whether it did."""
        return await self._topology.remake_consumer(stream, durable)

    # ---------------------------------------------------------------- publish
    async def publish(self, subject: str, msg: Message, msg_id: str | None = None, after: int | None = None) -> int:
        """Publish and wait for the server's ack; returns the message's stream sequence. ``msg_id`` deduplicates
        retries server-side; ``after``: the stream sequence of the last message on ``subject`` this writer knows
        (0: none); the server refuses the message if another was published there since (:class:`PublishConflict`)."""
        data = encode(msg, self.max_payload)
        headers = {"Nats-Msg-Id": msg_id} if msg_id else {}
        if after is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(after)

        async def send() -> api.PubAck:
            return await self._js.publish(subject, data, headers=headers or None)

        try:  # with an id it lands once, however often it is sent: sent again while the plane does not answer
            ack = await (ask_again(send, f"publishing on {subject}", self._js) if msg_id else send())
        except (APIError, NoRespondersError, NoStreamResponseError) as e:
            raise _refusal(subject, after, e) from e
        return int(ack.seq)

    async def publish_many(self, items: Sequence[tuple[str, Message | bytes, str | None]], oversize: Oversize | None = None) -> list[int]:
        """Pipelined publish of several messages (``publish_async``), waiting for every ack; returns their stream
        sequences (a duplicate's is the original's). A message may come encoded already (bytes within ``max_payload``).
        ``oversize``: what a message whose encoding exceeds ``max_payload`` is replaced with (published in its place);
        without it, such a message raises :class:`~astraflow.streams.codec.MessageTooLarge` before anything is published."""
        encoded = [(subject, await _encoded(msg, self.max_payload, oversize), msg_id) for subject, msg, msg_id in items]
        if not encoded:
            return []
        if all(msg_id for _, _, msg_id in encoded):  # a repeat lands once (Nats-Msg-Id): sent again at once after a reconnect
            return await ask_again(lambda: self._publish_encoded(encoded), f"publishing {len(encoded)} messages")
        return await self._publish_encoded(encoded)

    async def _publish_encoded(self, encoded: list[tuple[str, bytes, str | None]]) -> list[int]:
        reconnects = reconnects_of(self._js)
        futs = [await self._js.publish_async(subject, data, headers={"Nats-Msg-Id": msg_id} if msg_id else None)
                for subject, data, msg_id in encoded]
        # an ack lost with a server (a cluster member killed mid-publish) never arrives: nats-py's futures wait forever
        try:
            await acked(self._js, asyncio.wait(futs), PUBLISH_ACK_TIMEOUT_S, reconnects)
        except AcksLost as e:
            raise AcksLost(f"publications unacknowledged: {e} (publish again: Nats-Msg-Id deduplicates)") from None
        except TimeoutError:
            raise TimeoutError(f"{sum(not f.done() for f in futs)} of {len(futs)} publications unacknowledged after "
                               f"{PUBLISH_ACK_TIMEOUT_S:.0f}s (publish again: Nats-Msg-Id deduplicates)") from None
        return [int(f.result().seq) for f in futs]

    async def reject(self, subject: str, payload: bytes, reason: str, headers: dict[str, str] | None = None, code: str = "") -> None:
        """Dead-letter ``payload`` (first published on ``subject``) with ``reason`` (and the typed ``code`` of the check
        that failed) on ``dlq.{family of subject}``."""
        kind = subject.split(".")[2] if subject.count(".") >= 2 else "unknown"
        rej = Rejected(subject=subject, reason=reason[:2000], worker_id=self.worker_id, headers=dict(headers or {}), payload=payload,
                       code=code)
        await self._js.publish(self.names.dlq(kind), encode(rej))
        log.warning("rejected message on %s: %s", subject, reason[:300])

    # ---------------------------------------------------------------- consume
    def consumer(self, stream: str, durable: str, model: type[M]) -> Consumer[M]:
        """The durable pull consumer ``durable`` of ``stream``, handing out ``model`` deliveries."""
        return Consumer(self, stream, durable, functools.partial(decode, expected=model))

    def follower(self, subject: str, model: type[M], stream: str | None = None, domain: str | None = None,
                 start: Literal["last", "all"] = "last", on_bad: OnBad = log_bad, check: Check[M] | None = None) -> Follower[M]:
        """Follow ``subject`` of ``stream`` (default: the family's own stream; a mirror's name in ``domain``).
        ``check``: a message it returns a reason against goes to the DLQ (``dlq.{family}``) with its original bytes."""
        follower = Follower(self._js_for(domain or self.domain), stream or self._stream_of(subject), subject, model, start, on_bad,
                            check, self.reject)
        self._gone.followers.add(follower)
        return follower

    async def history(self, subject: str, model: type[M], stream: str | None = None, domain: str | None = None,
                      last_only: bool = False, on_bad: OnBad = log_bad) -> list[M]:
        """Every message ``stream`` still holds on ``subject`` (or only the last), decoded, oldest first."""
        js = self._js_for(domain or self.domain)
        return await read_history(js, stream or self._stream_of(subject), subject, model, last_only, on_bad=on_bad)

    async def follow(self, subject: str, model: type[M], cb: Callable[[M], Awaitable[None]], history: bool = True,
                     on_bad: OnBad = log_bad) -> Subscription:
        """Call ``cb`` with every message on ``subject`` (from the start of its stream when ``history``, else from the
        newest), in order, from a task of its own; through a :meth:`follower`, so it resumes as soon as a restarted
        server is back. An error of ``cb`` is logged and the messages after it are still handed over."""
        follower = self.follower(subject, model, start="all" if history else "last", on_bad=on_bad)
        return await follower.hand_over(cb)

    def _stream_of(self, subject: str) -> str:
        return self.names.stream(subject.split(".")[2])

    # ---------------------------------------------------------------- objects
    def objects(self, domain: str | None = None, stream: str | None = None, wait_missing: float = 0.0) -> ObjectStore:
        """The run's weight-payload bucket, as read in ``domain`` (a region's mirror: the same stream name there)."""
        bucket = self.names.object_bucket
        return ObjectStore(self._js_for(domain or self.domain), bucket, stream or object_stream(bucket), wait_missing,
                           self.max_payload)

    def trajectory_objects(self) -> ObjectStore:
        """The run's bucket for the arrays of trajectories too large for one message (``streams/trajectories.py``)."""
        return ObjectStore(self._js, self.names.traj_object_bucket, max_payload=self.max_payload)

    async def wait_for_domain(self, domain: str, timeout: float = 20.0, on_wait: Callable[[str], None] | None = None) -> None:
        """Return once JetStream of ``domain`` answers on this connection (the hub, through a leafnode)."""
        await _jetstream_answers(self._nc.jetstream(domain=domain, timeout=1.0), domain, timeout, on_wait)

    # ---------------------------------------------------------------- core NATS: heartbeats, advisories
    async def beat(self, hb: Heartbeat) -> None:
        await self._nc.publish(self.names.hb(hb.role, hb.worker_id), encode(hb))

    async def on_heartbeats(self, cb: Callable[[Heartbeat], None]) -> Subscription:
        """Call ``cb`` with every heartbeat of the run (undecodable ones are dropped: they are only liveness)."""
        sub = await self._nc.subscribe(f"af.{self.names.run}.hb.>", cb=functools.partial(_heartbeat_to, cb))
        await self._nc.flush()  # the server knows the interest before this returns
        return Subscription(sub.unsubscribe)

    async def on_max_deliveries(self, stream: str, durable: str, cb: Callable[[int], Awaitable[None]]) -> Subscription:
        """Call ``cb(stream_seq)`` for every message of ``durable`` the server gave up on (it ran out of deliveries), from
        the start: the DLQ stream keeps the server's advisories (``topology.py``), so one given while nobody listened
        (a dataflow restarting) is not lost. A restarted follower sees the old ones again: ``cb`` must be idempotent."""
        sub = await self._js.subscribe(self.names.max_deliveries_advisory(stream, durable), stream=self.names.dlq_stream,
                                       ordered_consumer=True, deliver_policy=api.DeliverPolicy.ALL,
                                       cb=functools.partial(_given_up_to, cb))
        return Subscription(sub.unsubscribe)


async def _encoded(msg: Message | bytes, max_payload: int, oversize: Oversize | None) -> bytes:
    """``msg`` as published (bytes come encoded already); one too large goes as what ``oversize`` replaces it with."""
    if isinstance(msg, bytes):
        return msg
    try:
        return encode(msg, max_payload)
    except MessageTooLarge:
        if oversize is None:
            raise
        return encode(await oversize(msg), max_payload)


async def _jetstream_answers(js: JetStreamContext, domain: str, timeout: float, on_wait: Callable[[str], None] | None) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await js.account_info()
            return
        except Exception as e:  # no responders / timeout until the leafnode link is up
            if loop.time() > deadline:
                raise TimeoutError(f"JetStream domain {domain!r} unreachable after {timeout:.0f}s: {type(e).__name__}") from None
            if on_wait is not None:
                on_wait(f"waiting for JetStream domain {domain!r}: {type(e).__name__}")
            await asyncio.sleep(0.1)


async def _heartbeat_to(cb: Callable[[Heartbeat], None], msg: Msg) -> None:
    try:
        cb(decode(msg.data, Heartbeat))
    except DecodeError as e:
        log.debug("undecodable heartbeat on %s: %s", msg.subject, e)


async def _given_up_to(cb: Callable[[int], Awaitable[None]], msg: Msg) -> None:
    """A max-deliveries advisory: ``cb`` with the stream sequence of the message the server gave up on."""
    try:
        seq = int(json.loads(msg.data)["stream_seq"])
    except (ValueError, KeyError, TypeError) as e:
        log.debug("max-deliveries advisory not understood: %s", e)
        return
    await cb(seq)


def _refusal(subject: str, after: int | None, e: Exception) -> PublishRefused:
    """Why the server refused a publication on ``subject``: another message published there after ``after``
    (:class:`PublishConflict`), a refusal it explained, or no stream that stores the subject."""
    if not isinstance(e, APIError):
        return PublishRefused(f"{subject}: no stream stores it")
    if after is not None and e.err_code == WRONG_LAST_SEQUENCE:
        return PublishConflict(f"{subject}: another message was published after sequence {after}: {e.description}")
    return PublishRefused(f"{subject}: {e.description or e}")
