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
event loop while the workflow thread waits). A node also watches for new versions while it
generates (``NodeWeights.watch``): each is fetched, decoded and checked as soon as it is
announced, so a safe point finds it ready and only the install waits for the engine. With
``rollout.partial_rollouts`` the engine installs it between two decoding steps of the
generations in flight (``hf``); without, between batches. An engine never applies weights
during a decoding step, so every token's version is true.
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
from functools import partial
from typing import Any

from astraflow.config import Recipe
from astraflow.metrics import Metrics, serving
from astraflow.models import load_tokenizer, model_limits
from astraflow.role import NodeOptions, Role
from astraflow.rollout.engines.base import RecordsRouting, SamplingParams, StaleWeights
from astraflow.rollout.engines.registry import build_engine
from astraflow.rollout.node_report import NODE_STATS, NodeReport
from astraflow.rollout.node_weights import NodeWeights
from astraflow.rollout.outbox import Outbox
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.slots import Slots
from astraflow.rollout.task_checks import TaskRules
from astraflow.rollout.task_gate import TaskGate
from astraflow.rollout.workflows.agent_sessions import AgentHost, NodeServices
from astraflow.rollout.workflows.base import PolicyHandle, Workflow
from astraflow.rollout.workflows.registry import check_policies, get_workflow
from astraflow.runtime import Stop, every
from astraflow.streams.codec import MessageTooLarge
from astraflow.streams.messages import Heartbeat, Task, Trajectory
from astraflow.streams.plane import Consumer, Delivery, Plane
from astraflow.streams.task_queue import TaskQueue

log = logging.getLogger(__name__)


def make_handle(recipe: Recipe, policy: str, params: SamplingParams | None = None, rollout: bool = False) -> PolicyHandle:
    """``policy``'s engine and sampling; ``rollout``: for a node's trajectories, which record the MoE routing the
    trainer asks for (``trainer.routing``)."""
    model_cfg = recipe.policies[policy].model
    tokenizer = load_tokenizer(model_cfg.tokenizer)
    engine = build_engine(model_cfg, recipe.rollout, tokenizer)
    if rollout and recipe.policies[policy].trainer.routing != "own":
        if not isinstance(engine, RecordsRouting):
            raise ValueError(f"trainer.routing: {recipe.policies[policy].trainer.routing}: engine "
                             f"{recipe.rollout.engine.type} cannot record routing (hf can)")
        engine.record_routing()
    r = recipe.rollout
    return PolicyHandle(engine, tokenizer, params or SamplingParams(r.max_new_tokens, r.temperature, r.top_p), name=policy,
                        context=model_limits(model_cfg).context)


def make_handles(recipe: Recipe, rollout: bool = False) -> dict[str, PolicyHandle]:
    """A handle per policy: each its own engine, or (``rollout.shared_base``) views of one engine holding the base once
    and every policy's adapter."""
    if not recipe.rollout.shared_base:
        return {p: make_handle(recipe, p, rollout=rollout) for p in recipe.policy_names}
    from astraflow.rollout.engines.shared_base import SharedBase

    shared = SharedBase.build(recipe)
    r = recipe.rollout
    return {p: PolicyHandle(shared.view(p), shared.engine.tokenizer, SamplingParams(r.max_new_tokens, r.temperature, r.top_p),
                            name=p, context=model_limits(recipe.policies[p].model).context) for p in recipe.policy_names}


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
        self.handles = handles if handles is not None else make_handles(recipe, rollout=True)
        self.stats = dict.fromkeys(NODE_STATS, 0.0)
        self.weights = NodeWeights(plane, self.handles, recipe.rollout.weights_domain, self.stats)
        self.report = NodeReport(self.stats, self.weights, metrics)  # heartbeat stats, Prometheus (``--metrics-port``)
        self.gate = TaskGate(TaskRules.of(recipe, uses_reward=getattr(workflow, "uses_reward", True)), self.weights,
                             self.handles, self.stats)  # which pulled tasks it serves now
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.agent_key = agent_key  # bearer token of the OpenAI-compatible endpoint (the rollout credential's password)
        self.endpoint = ""  # that endpoint's address, when the workflow serves one (advertised in heartbeats)
        self.slots: Slots | None = None  # the generation slots, once joined
        self.outbox = Outbox(plane, partial(self.report.add, "publish_s"))  # finished tasks: published and acked together
        self._admission_closed = asyncio.Event()  # set once the node admits no more tasks (told to stop)

    def _safe_point(self) -> bool:
        """Called from the workflow thread between turns; blocks it while the loop refreshes."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self.weights.refresh(), self._loop).result(timeout=600)

    async def beat(self) -> None:
        if self.slots is not None:
            self.stats["held"] = float(len(self.slots.held))
        self.report.export(self.draining)
        await self.plane.beat(Heartbeat(worker_id=self.worker_id, pool=self.pool, region=self.region, hardware=self.hardware,
                                        policy=self.recipe.primary, version=self.weights.version(self.recipe.primary),
                                        stats=self.report.heartbeat_stats(self.endpoint),
                                        state="draining" if self.draining else "running", metrics=serving()))

    async def run(self, stop: Stop, joined: Callable[[], None] = lambda: None) -> None:
        """Serve tasks until ``stop``; ``joined`` is called once the node holds the current weights."""
        self._loop = asyncio.get_running_loop()
        for h in self.handles.values():
            h.safe_point_fn = self._safe_point
        topo = dataclasses.replace(self.recipe.topology(), pools=(self.pool,))
        await self.plane.ensure_topology(topo, create=False)
        chores = [asyncio.create_task(every(2.0, self.beat, stop))]
        try:
            await self.weights.join(stop)  # joining: the current weights first, however long a warm start takes
            joined()
            chores.append(asyncio.create_task(self.weights.watch(stop)))  # after the join: versions ready before a safe point
            if isinstance(self.workflow, AgentHost):
                self.endpoint = self.workflow.start(NodeServices(self.worker_id, self.handles, self._publish_from_thread,
                                                                 lambda: self.draining, self.agent_key))
                log.info("OpenAI-compatible endpoint for agents: %s/v1", self.endpoint)
                if self.workflow.external:  # agents pull the tasks themselves and open sessions here
                    await self._host_agents(self.workflow, stop)
                    return
            tasks = TaskQueue(self.plane, self.pool).pull()
            settings = await tasks.settings()  # the server's, not our defaults
            ack_wait, max_deliver = settings.ack_wait, settings.max_deliver
            self.stats["joined"] = 1.0
            log.info("rollout node %s joined pool %s (region %r, %s) at %s", self.worker_id, self.pool, self.region,
                     self.hardware, {p: s.version for p, s in self.weights.syncs.items()})
            self.slots = Slots(self.recipe.rollout.tasks_per_generate, ack_wait / 3)
            for handle in self.handles.values():  # every slot may call every policy
                handle.engine.expect_callers(self.slots.size)
            async with self.slots.kept_alive():
                await self._admit_while_running(tasks, self.slots, stop, max_deliver)
        finally:
            self.draining = True
            stop.set()
            await asyncio.gather(*chores, return_exceptions=True)
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
            await self.weights.refresh()
            self.stats.update(host.counters())
        self.draining = True
        if not await asyncio.to_thread(host.wait_idle, self.recipe.rollout.drain_timeout):
            log.info("left with agent sessions open: their agents' tasks are redelivered")

    def _publish_from_thread(self, trajs: list[Trajectory]) -> None:
        """Publish an agent session's trajectories (called from the endpoint's threads); returns once they are stored."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self.outbox.publish(trajs), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self.report.done, trajs)

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
            await self.weights.refresh()  # a safe point (hf: between batches, or between decoding steps with partial rollouts)
            if not got:
                continue
            if stop.is_set():  # told to stop while the fetch was open: give these back untouched
                await asyncio.gather(*(d.nak() for d in got))
                self.stats["drained_naks"] += len(got)
                break
            for d in await self.gate.admit(got):
                slots.start(d, self.serve_task(d, slots, stop, max_deliver))

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
        slots.vacate()  # generated: the next task takes the slot while this one settles
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
        self.report.done(trajs)

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


async def serve(recipe: Recipe, options: NodeOptions) -> None:
    import torch

    if options.weights_domain:
        recipe = recipe.model_copy(update={"rollout": recipe.rollout.model_copy(update={"weights_domain": options.weights_domain})})
    torch.set_num_threads(recipe.rollout.threads)
    async with Role("rollout", options, recipe.plane.server_gone_timeout) as role:
        nats = options.nats
        key = (nats.password or os.environ.get("NATS_PASSWORD")) if nats.user else None  # agents present the same secret
        node = RolloutNode(recipe, role.plane, options.worker_id, options.pool, options.region, options.hardware,
                           metrics=role.metrics, agent_key=key)
        for h in node.handles.values():
            role.on_exit(h.engine.close)
        if callable(close := getattr(node.workflow, "close", None)):  # a workflow that holds servers (the OpenAI facade)
            role.on_exit(close)
        await node.run(role.stop, role.started)  # the node beats itself (tests drive it without a Role); the Role watches the server
