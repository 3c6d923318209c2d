"""What every role process does around its own work, written once (``Role``).

    async with Role("dataflow", options, recipe.plane.server_gone_timeout) as role:
        role.every(HEARTBEAT_PERIOD_S, beat)          # heartbeats and other chores, until the role stops
        while not role.stop.is_set():
            ...                                         # the role's own loop, on role.plane
        await role.leave()                              # optional: chores stopped, the plane still open for a last flush

``options`` is where the role joins and who it is (:class:`RoleOptions`); the trainer and the rollout node take a
model of their own beside it (:class:`TrainerOptions`, :class:`NodeOptions`), which ``astraflow worker`` builds from its
flags and which refuses a flag of another role by name.

On entry: the Prometheus endpoint (when ``metrics_port`` is given), the connection with the role's credential, the stop
signals (``runtime.stop_event``: SIGTERM drains, SIGHUP from a dead launcher leaves now) and the server watchdog (leave
once the server has been gone ``server_gone_timeout`` seconds). On exit, in this order: stop, wait for the chores and the
watchdog, run the closers the role registered (``on_exit``: engines, servers it launched), close the plane.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from astraflow.metrics import Metrics, start_metrics_server
from astraflow.runtime import Stop, every, stop_event, watch_server
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.subjects import check_token
from astraflow.train.threads import pin

log = logging.getLogger(__name__)


class RoleOptions(BaseModel):
    """Where a role joins and who it is: every role's (the dataflow and the evaluator need nothing more)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    nats: NatsOptions
    run: str
    worker_id: str
    metrics_port: int | None = Field(None, ge=0, le=65535)  # serve Prometheus metrics here (0: a free port, logged)
    cores: tuple[int, ...] | None = None  # the CPUs it keeps to once started (``Role.started``); its start-up may use any

    @field_validator("cores")
    @classmethod
    def _cores(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and (not value or min(value) < 0):
            raise ValueError("give one CPU number or more, none negative")
        return value

    @field_validator("run", "worker_id")
    @classmethod
    def _token(cls, value: str, info: ValidationInfo) -> str:
        return check_token(str(info.field_name).replace("_", " "), value)  # both name NATS subjects


class NodeOptions(RoleOptions):
    """A rollout node's: which pool it pulls from, how it labels itself, where it reads weights."""

    pool: str | None = None  # default: rollout.pool
    region: str | None = None  # default: rollout.region
    hardware: str | None = None  # default: rollout.hardware, else cuda/cpu as detected
    weights_domain: str | None = None  # read weights from the mirrors in this JetStream domain (a region's leaf)


class TrainerOptions(RoleOptions):
    """A trainer's: which policy, where its checkpoints are, and whether it starts a new lineage."""

    policy: str | None = None  # default: the recipe's first
    checkpoint_dir: Path | None = None  # a restart resumes from it (default: none, start at v0)
    fresh_lineage: bool = False  # start over from the initial weights, announced after the plane's newest version

    @field_validator("cores")
    @classmethod
    def _own_cores(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None:
            raise ValueError("a trainer runs on trainer.cores once its warm start is done (--set 'trainer.cores=[0,1]')")
        return value


def options_for(role: str) -> type[RoleOptions]:
    """The option model of ``role`` (``dataflow``, ``rollout``, ``trainer``, ``evaluator``)."""
    own: dict[str, type[RoleOptions]] = {"rollout": NodeOptions, "trainer": TrainerOptions}
    return own.get(role, RoleOptions)


class Role:
    def __init__(self, kind: str, options: RoleOptions, server_gone_timeout: float, policy: str = "",
                 metrics: bool = True) -> None:
        """``metrics``: False for a passing role (a trainer's warm start) that must not take the metrics port."""
        self.kind, self.nats, self.run, self.worker_id = kind, options.nats, options.run, options.worker_id
        self.server_gone_timeout = server_gone_timeout
        self.metrics_port = options.metrics_port if metrics else None
        self.cores = options.cores
        self.policy = policy
        self.metrics: Metrics | None = None  # exported when a metrics port was given
        self._plane: Plane | None = None
        self._stop: Stop | None = None
        self._chores: list[asyncio.Task[None]] = []
        self._closers: list[Callable[[], object]] = []

    @property
    def plane(self) -> Plane:
        if self._plane is None:
            raise RuntimeError(f"{self.kind}: the role is not entered (use `async with Role(...)`)")
        return self._plane

    @property
    def stop(self) -> Stop:
        if self._stop is None:
            raise RuntimeError(f"{self.kind}: the role is not entered (use `async with Role(...)`)")
        return self._stop

    async def __aenter__(self) -> Role:
        if self.metrics_port is not None:
            self.metrics = Metrics(self.kind, policy=self.policy, worker=self.worker_id)
            log.info("Prometheus metrics on :%d/metrics", start_metrics_server(self.metrics_port))
        self._plane = await Plane.connect(self.nats, self.run, self.worker_id)
        self._stop = stop_event()
        self._chores.append(asyncio.create_task(watch_server(self._plane, self._stop, self.server_gone_timeout)))
        return self

    def started(self) -> None:
        """The role's start-up (imports, model build, the first weights) is done: from now on it runs on ``cores``
        alone. ``up`` starts the roles beside a pinned trainer on every core, so their start-ups do not queue on the
        cores left to them while the trainer's sit idle, and moves them there at this point. Safe to call twice."""
        if self.cores is not None and pin(self.cores):
            log.info("%s on CPUs %s", self.kind, list(self.cores))
        self.cores = None

    def every(self, seconds: float, chore: Callable[[], Awaitable[None]]) -> None:
        """Run ``chore`` every ``seconds`` until the role stops (an error is logged, never fatal)."""
        self._chores.append(asyncio.create_task(every(seconds, chore, self.stop)))

    def on_exit(self, closer: Callable[[], object]) -> None:
        """Call ``closer`` when the role leaves, after its chores and before the plane closes (last registered, first)."""
        self._closers.append(closer)

    async def leave(self) -> None:
        """Stop: the chores and the watchdog end; the plane stays open (for a last flush). Safe to call twice."""
        self.stop.set()
        chores, self._chores = self._chores, []
        await asyncio.gather(*chores, return_exceptions=True)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if self._stop is not None:
                await self.leave()
            for closer in reversed(self._closers):
                try:
                    result = closer()
                    if asyncio.iscoroutine(result):
                        await result
                except Exception:  # one closer failing must not keep the others (or the plane) open
                    log.exception("%s: closing %s failed", self.kind, getattr(closer, "__qualname__", closer))
        finally:
            if self._plane is not None:
                await self._plane.close()
