"""The RaaS node (``astraflow worker rollout``): pull tasks from the pool's shared durable consumer, roll out, publish.

Joining = binding the shared consumer, fetching the current weights, pulling tasks. A node keeps
``rollout.tasks_per_generate`` generation slots busy: it admits a task whenever a slot frees, and
each task is its own workflow call, so a slow task never holds the others back (``slots.py``; the
engine batches what the slots ask for together). A task is acked only after its trajectories are
stored; tasks that finish together are published in one go and acked together (``outbox.py``).
A task the node can never serve (another workflow or policy, another group size, a floor
above any announced version, a prompt the model cannot hold, a meta the reward cannot score: ``task_checks.py``) is dead-lettered with its
reason before it reaches the workflow. A task the node cannot serve yet (weights older
than the task allows) is nak'ed back with a delay. A node told to stop (SIGTERM) stops
admitting, finishes what it holds within ``rollout.drain_timeout`` and naks the rest back to
the pool. A node that dies is covered by the server's ``ack_wait`` redelivery; its
trajectories, if it published any, are deduplicated by their ids.

Weights are refreshed at safe points: between generations, and between turns of a multi-turn
episode (the workflow calls ``PolicyHandle.safe_point``, which runs the refresh on the node's
event loop while the workflow thread waits). With ``rollout.partial_rollouts`` the node also
looks for a new version every ``WATCH_S`` while it generates, and the engine applies it between
two decoding steps of the generations in flight (``hf``). An engine never applies weights during
a decoding step, so every token's version is true.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from astraflow.config import Recipe
from astraflow.metrics import Metrics, serving
from astraflow.models import encode_prompt, load_tokenizer, model_limits
from astraflow.role import Role
from astraflow.rollout.engines.base import SamplingParams, StaleWeights
from astraflow.rollout.engines.registry import build_engine
from astraflow.rollout.outbox import Outbox
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.slots import Slots
from astraflow.rollout.task_checks import TaskProblem, TaskRules, check_prompt, check_task, check_versions
from astraflow.rollout.workflows.agent_sessions import AgentHost, NodeServices
from astraflow.rollout.workflows.base import PolicyHandle, Workflow
from astraflow.rollout.workflows.registry import check_policies, get_workflow
from astraflow.runtime import Stop, every
from astraflow.streams.codec import MessageTooLarge
from astraflow.streams.messages import Heartbeat, RolloutStats, Task, Trajectory
from astraflow.streams.plane import Consumer, Delivery, NatsOptions, Plane
from astraflow.streams.state import StateReadError, VersionRecord
from astraflow.streams.trajectories import publish_trajectories
from astraflow.weights.sync import WeightSync

log = logging.getLogger(__name__)
FULL_REFRESH_S = 5.0
WATCH_S = 0.25  # ``rollout.partial_rollouts``: how often a node looks for a new version while it generates
NODE_GAUGES = ("held", "joined")  # the other node stats are cumulative: exported as counters
WEIGHT_SYNC_STATS = ("keyframes", "deltas", "bytes", "joins", "fallbacks", "failures", "refetches", "rejected",
                     "keyframe_requests")  # WeightSync.stats keys exported from the start (others when they appear)
NODE_COUNTERS = {"gen_s": "gen_seconds", "pull_s": "pull_seconds", "publish_s": "publish_seconds",
                 "refresh_s": "refresh_seconds"}  # renamed for Prometheus (others keep their stats key)


def make_handle(recipe: Recipe, policy: str, params: SamplingParams | None = None) -> PolicyHandle:
    model_cfg = recipe.policies[policy].model
    tokenizer = load_tokenizer(model_cfg.tokenizer)
    engine = build_engine(model_cfg, recipe.rollout, tokenizer)
    r = recipe.rollout
    return PolicyHandle(engine, tokenizer, params or SamplingParams(r.max_new_tokens, r.temperature, r.top_p), name=policy,
                        context=model_limits(model_cfg).context)


class RolloutNode:
    """One RaaS node on an open plane. ``run(stop)`` serves until ``stop`` is set, then drains."""

    def __init__(self, recipe: Recipe, plane: Plane, worker_id: str, pool: str | None = None, region: str | None = None,
                 hardware: str | None = None, handles: dict[str, PolicyHandle] | None = None,
                 workflow: Workflow | None = None, metrics: Metrics | None = None, agent_key: str | None = None) -> None:
        self.recipe = recipe
        self.plane = plane
        self.worker_id = worker_id
        self.pool = pool or recipe.rollout.pool
        self.region = recipe.rollout.region if region is None else region
        self.hardware = hardware or recipe.rollout.hardware or _detect_hardware()
        if workflow is None:  # the recipe's (its plug-ins were imported when the recipe was loaded)
            check_policies(recipe.workflow, recipe.policy_names)
            workflow = get_workflow(recipe.workflow_options, get_reward(recipe.reward))
        self.workflow = workflow
        self.task_rules = TaskRules.of(recipe, uses_reward=getattr(workflow, "uses_reward", True))
        self.handles = handles if handles is not None else {p: make_handle(recipe, p) for p in recipe.policy_names}
        domain = recipe.rollout.weights_domain
        self.syncs = {p: WeightSync(plane, p, h.engine, domain=domain) for p, h in self.handles.items()}
        self.stats: dict[str, float] = {"tasks": 0.0, "trajectories": 0.0, "tokens": 0.0, "gen_s": 0.0, "pull_s": 0.0, "publish_s": 0.0,
                                        "failed": 0.0, "stale_naks": 0.0, "drained_naks": 0.0, "held": 0.0, "refreshes": 0.0,
                                        "refresh_s": 0.0, "refresh_errors": 0.0, "joined": 0.0, "rejected_tasks": 0.0}
        self.announced = {p: -1 for p in self.handles}  # newest version seen announced, per policy
        self.draining = False
        self._last_full_refresh = 0.0
        self._refresh_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics = metrics  # Prometheus export (``--metrics-port``); None: none
        self.agent_key = agent_key  # bearer token of the OpenAI-compatible endpoint (the rollout credential's password)
        self.endpoint = ""  # that endpoint's address, when the workflow serves one (advertised in heartbeats)
        self._exported: dict[tuple[str, str], float] = {}  # counters' values at the last export
        self.slots: Slots | None = None  # the generation slots, once joined
        self.outbox = Outbox(plane, self._count_publish)  # finished tasks: published and acked together
        self._admission_closed = asyncio.Event()  # set once the node admits no more tasks (told to stop)

    # ------------------------------------------------------------ metrics
    def export_metrics(self) -> None:
        """Push the node's stats to Prometheus: cumulative stats as counters (``..._total``), the rest as gauges.

        Node-wide metrics carry ``policy=""``; per-policy ones (``version``, ``weight_sync_*``) the policy."""
        if self.metrics is None:
            return
        counters = {NODE_COUNTERS.get(k, k): v for k, v in self.stats.items() if k not in NODE_GAUGES}
        self.metrics.set({k: self.stats[k] for k in NODE_GAUGES})
        self.metrics.set({"draining": float(self.draining)})
        self._inc(self.metrics, "", counters)
        for p, sync in self.syncs.items():
            m = self.metrics.child(p)
            m.set({"version": float(sync.version), "announced_version": float(self.announced[p])})
            totals = {**dict.fromkeys(WEIGHT_SYNC_STATS, 0.0), **sync.stats}  # every series exists from the start
            self._inc(m, p, {f"weight_sync_{k}": float(v) for k, v in totals.items()})

    def _inc(self, m: Metrics, policy: str, totals: dict[str, float]) -> None:
        deltas = {}
        for key, total in totals.items():
            delta = total - self._exported.get((policy, key), 0.0)
            if delta > 0 or (policy, key) not in self._exported:
                deltas[key] = delta
                self._exported[(policy, key)] = total
        m.inc(deltas)

    # ------------------------------------------------------------ weights
    async def _newer_announced(self) -> list[str]:
        """Policies whose trainer has published a version newer than ours (the run-state KV's
        ``version.{policy}``, written after each announcement: one cheap read, allowed to a
        rollout node under the per-role permissions)."""
        out = []
        for p, sync in self.syncs.items():
            try:
                record = await self.plane.state.get(VersionRecord, p)
            except StateReadError:  # unreadable: the periodic full refresh covers it
                continue
            latest = record.version if record is not None else -1
            self.announced[p] = max(self.announced[p], latest)
            if self.announced[p] > sync.version:
                out.append(p)
        return out

    async def refresh(self) -> bool:
        """A safe point: apply every announced version the node has not applied yet.

        Reading the weights stream costs a fetch with a timeout, so it happens only when the KV
        says a newer version exists, or every ``FULL_REFRESH_S`` in case the KV is not readable
        here (a region that reads only its mirror)."""
        async with self._refresh_lock:
            t0 = time.perf_counter()
            try:
                return await self._refresh()
            finally:
                self.stats["refresh_s"] += time.perf_counter() - t0

    async def _refresh(self) -> bool:
        now = time.monotonic()
        due = now - self._last_full_refresh > FULL_REFRESH_S
        todo = list(self.syncs) if due else await self._newer_announced()
        if not todo:
            return False
        if due:
            self._last_full_refresh = now
        changed = False
        for p in todo:
            try:
                changed |= await self.syncs[p].refresh()
            except Exception as e:  # keep serving what the weights allow; tasks that need newer ones go back
                self.stats["refresh_errors"] += 1
                log.warning("refreshing %s failed: %s", p, e)
        if changed:
            self.stats["refreshes"] += 1
        return changed

    async def _refresh_now(self) -> None:
        await self.refresh()

    def _safe_point(self) -> bool:
        """Called from the workflow thread between turns; blocks it while the loop refreshes."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self.refresh(), self._loop).result(timeout=600)

    def ready_for(self, task: Task) -> bool:
        return all(self.syncs[p].version >= v for p, v in task.min_versions.items() if p in self.syncs)

    # ------------------------------------------------------------ task checks
    def newest_versions(self) -> dict[str, int]:
        """The newest version of each policy this node knows was announced (KV, follower, or held)."""
        out = {}
        for p, sync in self.syncs.items():
            followed = sync.newest.version if sync.newest is not None else -1
            out[p] = max(self.announced[p], followed, sync.version)
        return out

    async def task_problem(self, task: Task) -> TaskProblem | None:
        """Why this node can never serve ``task`` (``task_checks.py``), or None. A floor above the newest version
        it knows is confirmed on the plane first (its view may lag a trainer that just announced)."""
        rules = self.task_rules
        problem = check_task(task, rules) or check_prompt(task.prompt, rules, self._count_tokens)
        if problem is not None or check_versions(task, self.newest_versions(), rules.window) is None:
            return problem
        try:
            for p in self.syncs:
                record = await self.plane.state.get(VersionRecord, p)
                if record is not None:
                    self.announced[p] = max(self.announced[p], record.version)
        except StateReadError as e:  # not confirmed: the task waits (nak) rather than being turned away on a guess
            log.warning("cannot confirm the newest versions (%s); task %s waits", e, task.task_id)
            return None
        return check_versions(task, self.newest_versions(), rules.window)

    def _count_tokens(self, policy: str, text: str) -> int:
        return len(encode_prompt(self.handles[policy].tokenizer, text))

    async def servable(self, got: list[Delivery[Task]]) -> list[Delivery[Task]]:
        """The deliveries this node can serve; the others go to the DLQ (``dlq.task``) with their reason."""
        out = []
        for d in got:
            problem = await self.task_problem(d.msg)
            if problem is None:
                out.append(d)
                continue
            self.stats["rejected_tasks"] += 1
            await d.reject(problem.reason)
        return out

    # ------------------------------------------------------------ liveness
    async def beat(self) -> None:
        if self.slots is not None:
            self.stats["held"] = float(len(self.slots.held))
        self.export_metrics()
        await self.plane.beat(Heartbeat(worker_id=self.worker_id, pool=self.pool, region=self.region, hardware=self.hardware,
                                        policy=self.recipe.primary, version=self.syncs[self.recipe.primary].version,
                                        stats=self.heartbeat_stats(), state="draining" if self.draining else "running",
                                        metrics=serving()))

    def heartbeat_stats(self) -> RolloutStats:
        typed = set(RolloutStats.model_fields) - {"role", "counters", "weights", "joined", "endpoint"}
        s = self.stats
        return RolloutStats(**{k: s[k] for k in typed}, joined=bool(s["joined"]), endpoint=self.endpoint,
                            counters={k: v for k, v in s.items() if k not in typed and k != "joined"},
                            weights={p: {k: float(v) for k, v in sync.stats.items()} for p, sync in self.syncs.items()})

    # ------------------------------------------------------------ main loop
    async def run(self, stop: Stop) -> None:
        self._loop = asyncio.get_running_loop()
        for h in self.handles.values():
            h.safe_point_fn = self._safe_point
        topo = dataclasses.replace(self.recipe.topology(), pools=(self.pool,))
        await self.plane.ensure_topology(topo, create=False)
        beats = asyncio.create_task(every(2.0, self.beat, stop))
        if self.recipe.rollout.partial_rollouts:  # a version lands inside the generations in flight, not after them
            watch = asyncio.create_task(every(WATCH_S, self._refresh_now, stop))
            beats.add_done_callback(lambda _: watch.cancel())
        try:
            for policy, sync in self.syncs.items():  # joining: the current weights first, however long a warm start takes
                while sync.version < 0 and not stop.is_set():
                    try:
                        await sync.wait_for(0, timeout=60)
                    except TimeoutError as e:
                        log.info("still waiting for the first weights of %s: %s", policy, e)
            self._last_full_refresh = time.monotonic()
            if isinstance(self.workflow, AgentHost):
                self.endpoint = self.workflow.start(NodeServices(self.worker_id, self.handles, self._publish_from_thread,
                                                                 lambda: self.draining, self.agent_key))
                log.info("OpenAI-compatible endpoint for agents: %s/v1", self.endpoint)
                if self.workflow.external:  # agents pull the tasks themselves and open sessions here
                    await self._host_agents(self.workflow, stop)
                    return
            names = self.plane.names
            tasks = self.plane.consumer(names.task_stream, names.pool_consumer(self.pool), Task)
            settings = await tasks.settings()  # the server's, not our defaults
            ack_wait, max_deliver = settings.ack_wait, settings.max_deliver
            self.stats["joined"] = 1.0
            log.info("rollout node %s joined pool %s (region %r, %s) at %s", self.worker_id, self.pool, self.region,
                     self.hardware, {p: s.version for p, s in self.syncs.items()})
            self.slots = Slots(self.recipe.rollout.tasks_per_generate, ack_wait / 3)
            for handle in self.handles.values():  # every slot may call every policy
                handle.engine.expect_callers(self.slots.size)
            async with self.slots.kept_alive():
                await self._admit_while_running(tasks, self.slots, stop, max_deliver)
        finally:
            self.draining = True
            stop.set()
            await asyncio.gather(beats, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.beat()
            log.info("rollout node %s left: %s", self.worker_id, {k: v for k, v in self.stats.items() if v})

    async def _host_agents(self, host: AgentHost, stop: asyncio.Event) -> None:
        """Serve external agents' sessions until told to stop, refreshing weights between their calls; then give open
        sessions ``rollout.drain_timeout`` seconds to finish."""
        self.stats["joined"] = 1.0
        log.info("rollout node %s serves agent sessions (pool %s): agents pull the tasks", self.worker_id, self.pool)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            await self.refresh()
            self.stats.update(host.counters())
        self.draining = True
        if not await asyncio.to_thread(host.wait_idle, self.recipe.rollout.drain_timeout):
            log.info("left with agent sessions open: their agents' tasks are redelivered")

    def _count_publish(self, seconds: float) -> None:
        self.stats["publish_s"] += seconds

    def _publish_from_thread(self, trajs: list[Trajectory]) -> None:
        """Publish an agent session's trajectories (called from the endpoint's threads); returns once they are stored."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._publish_session(trajs), self._loop).result(timeout=60)

    async def _publish_session(self, trajs: list[Trajectory]) -> None:
        t0 = time.perf_counter()
        await publish_trajectories(self.plane, trajs)  # a long session goes by reference, like any trajectory
        self.stats["publish_s"] += time.perf_counter() - t0
        self.stats["tasks"] += 1
        self.stats["trajectories"] += len(trajs)
        self.stats["tokens"] += sum(len(t.completion_ids) // 4 for t in trajs)

    async def _admit_while_running(self, tasks: Consumer[Task], slots: Slots, stop: asyncio.Event, max_deliver: int) -> None:
        """Per-slot admission: pull as many tasks as there are free slots, whenever a slot frees, until told to stop.

        A slow task holds its own slot only; the others keep finishing and being replaced (``slots.py``). Slots are
        concurrent workflow calls rather than sequences admitted into a running engine batch: any workflow (multi-turn,
        tools, two policies) gets them unchanged, server engines batch concurrent requests at decode steps themselves,
        and ``hf``, which on CPU cannot overlap two calls anyway, folds the calls waiting for it into its next batch."""
        try:
            await self._admit(tasks, slots, stop, max_deliver)
        finally:
            self._admission_closed.set()  # no fetch is open any more: a drained task may go back without coming here again

    async def _admit(self, tasks: Consumer[Task], slots: Slots, stop: asyncio.Event, max_deliver: int) -> None:
        while not stop.is_set():
            await slots.wait_free(stop)
            if stop.is_set():
                break
            t0 = time.perf_counter()
            got = await tasks.pull(batch=slots.free, timeout=1.0)
            if got:
                self.stats["pull_s"] += time.perf_counter() - t0
            await self.refresh()  # a safe point: the engine's lock keeps it between generations
            if not got:
                continue
            if stop.is_set():  # told to stop while the fetch was open: give these back untouched
                await asyncio.gather(*(d.nak() for d in got))
                self.stats["drained_naks"] += len(got)
                break
            for d in await self.admit(got):
                slots.start(d, self.serve_task(d, slots, stop, max_deliver))

    async def admit(self, got: list[Delivery[Task]]) -> list[Delivery[Task]]:
        """The deliveries to serve now: impossible ones are dead-lettered, ones newer than the weights nak'ed (1 s)."""
        got = await self.servable(got)
        ready = [d for d in got if self.ready_for(d.msg)]
        stale = [d for d in got if d not in ready]
        if stale:
            await asyncio.gather(*(d.nak(delay=1.0) for d in stale))
            self.stats["stale_naks"] += len(stale)
        return ready

    async def serve_task(self, d: Delivery[Task], slots: Slots, stop: asyncio.Event, max_deliver: int) -> None:
        """One task in one slot: play it, publish its trajectories, and only then ack it (or nak/term it on purpose)."""
        t0 = time.perf_counter()
        try:
            trajs = await self._run_workflow([d], stop)
        except StaleWeights as e:  # the workflow refused: weights older than the task allows
            log.warning("%s; returning task %s", e, d.msg.task_id)
            await d.nak(delay=1.0)
            self.stats["stale_naks"] += 1
            return
        except Exception as e:
            log.exception("workflow failed on task %s", d.msg.task_id)
            self.stats["failed"] += 1
            if d.num_delivered >= max_deliver - 1:
                await d.reject(f"workflow failed {d.num_delivered}x: {e}")
            else:
                await d.nak(delay=2.0)
            return
        finally:  # slot-seconds over slots: the slope of gen_s is the share of the node's capacity in use
            self.stats["gen_s"] += (time.perf_counter() - t0) / slots.size
        if trajs is None:  # drained: not finished in time, handed back (after an urgent stop, ack_wait redelivers it)
            await self._admission_closed.wait()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(d.nak(), 5)
            self.stats["drained_naks"] += 1
            return
        try:  # published with the trajectories of the tasks that finished meanwhile, then acked (``outbox.py``)
            await self.outbox.settle(d, trajs)  # one too large for a message goes by reference (object store)
        except MessageTooLarge as e:  # even by reference it will never fit: dead-letter the task rather than retry it forever
            await d.reject(f"trajectory too large to publish: {e}")
            self.stats["failed"] += 1
            return
        except Exception as e:  # a server hiccup: give the task back (published trajectories are deduplicated on retry)
            log.warning("publishing trajectories failed (%s); returning task %s", e, d.msg.task_id)
            with contextlib.suppress(Exception):
                await d.nak(delay=2.0)
            self.stats["failed"] += 1
            return
        self.stats["tasks"] += 1
        self.stats["trajectories"] += len(trajs)
        self.stats["tokens"] += sum(len(t.completion_ids) // 4 for t in trajs)

    async def _run_workflow(self, ready: list[Delivery[Task]], stop: asyncio.Event) -> list[Trajectory] | None:
        """The workflow's trajectories; None if the node was told to stop and the work outlived the drain timeout."""
        work = in_daemon_thread(self.workflow.run, [d.msg for d in ready], self.handles, self.worker_id)
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                drain = 0.0 if getattr(stop, "urgent", False) else self.recipe.rollout.drain_timeout
                if not self.draining:
                    log.info("stopping: waiting up to %.0fs for the tasks in flight", drain)
                self.draining = True
                done, _ = await asyncio.wait({work}, timeout=drain) if drain > 0 else (set(), None)
                if not done:
                    work.add_done_callback(lambda f: f.exception())  # the thread ends on its own; its result is dropped
                    return None
            return work.result()
        finally:
            stopping.cancel()


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """Run blocking ``fn`` on a daemon thread (unlike ``to_thread``, one that outlives a drain never blocks exit)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the awaiting coroutine
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(settle, False, e)
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, True, result)

    threading.Thread(target=target, name=f"workflow-{getattr(fn, '__name__', 'run')}", daemon=True).start()
    return fut


def _detect_hardware() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


async def serve(recipe: Recipe, nats: NatsOptions, run: str, worker_id: str, pool: str | None = None,
                region: str | None = None, hardware: str | None = None, metrics_port: int | None = None) -> None:
    import torch

    torch.set_num_threads(recipe.rollout.threads)
    async with Role("rollout", nats, run, worker_id, recipe.plane.server_gone_timeout, metrics_port) as role:
        key = (nats.password or os.environ.get("NATS_PASSWORD")) if nats.user else None  # agents present the same secret
        node = RolloutNode(recipe, role.plane, worker_id, pool, region, hardware, metrics=role.metrics, agent_key=key)
        for h in node.handles.values():
            role.on_exit(h.engine.close)
        if callable(close := getattr(node.workflow, "close", None)):  # a workflow that holds servers (the OpenAI facade)
            role.on_exit(close)
        await node.run(role.stop)  # the node beats itself (tests drive it without a Role); the Role watches the server
