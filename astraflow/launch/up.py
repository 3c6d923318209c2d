"""``astraflow up``: the embedded server (or ``--nats``), every role as a supervised process, a live view, the summary.

The embedded server is secure by default: the run gets per-role credentials (owner-only files in
``RUN_DIR/credentials``) and the server enforces the per-role permissions of
``streams/permissions.py``; a process without a credential can publish nothing. Beyond
loopback (``--listen 0.0.0.0:4222``) TLS is on. On ``--resume`` the server comes back on the same
address, with the same credentials, so hand-joined nodes reconnect by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from astraflow.config import Recipe, dump_recipe
from astraflow.launch.access import ServerAccess
from astraflow.launch.diagnose import stall_report
from astraflow.launch.report import summarize
from astraflow.launch.rundir import RunDir
from astraflow.launch.supervisor import Child, CrashLoop, LocalPool, RoleSpec, Supervisor, exit_text
from astraflow.launch.view import View
from astraflow.launch.warm_base import warm_shared_base
from astraflow.launch.watcher import RunWatcher
from astraflow.rollout.eval_plan import eval_subjects, eval_versions
from astraflow.runtime import cancel_and_wait, run_event_loop
from astraflow.streams.credentials import Credential, is_loopback, issue, make_tls, node_path, redact
from astraflow.streams.messages import HEARTBEAT_PERIOD_S
from astraflow.streams.permissions import Scope
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.server import EmbeddedServer, cluster_members, free_port
from astraflow.train.base_warm_start import base_key, held_key, needs_base_warm_start
from astraflow.train.threads import pin, shared_cores, usable_core_ids, usable_cores, with_core_plan, with_thread_counts

console = Console()
LAUNCHER_TURN_S = 0.25  # the launcher's turns (announcements, the dataflow's count, the view) at most this often


class RunFailed(RuntimeError):
    """The run stopped without finishing (a crash loop, a timeout); the message says why, ``detail`` where it stood."""

    def __init__(self, why: str, detail: str = "") -> None:
        super().__init__(f"{why}; where it stood:\n{detail}" if detail else why)
        self.why = why


def recipe_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Fields that differ between two resolved recipes, as ``a.b: old -> new``."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += recipe_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def start_server(rundir: RunDir, recipe: Recipe, listen: str | None, cores: tuple[int, ...] | None = None,
                 cluster: int = 1) -> tuple[list[EmbeddedServer], dict[str, Credential], ServerAccess]:
    """The run's embedded server with authentication (a credential per role, and one per rollout node: the run's own
    ``rollout-{i}`` and any added before), on the address it had before when it can; ``cluster`` > 1: that many
    servers on loopback forming one JetStream cluster (:func:`start_cluster`)."""
    address_file = rundir.nats / "address"
    host, _, port = (listen or "127.0.0.1:-1").rpartition(":")
    if cluster > 1 and not is_loopback(host):
        raise RunFailed(f"--cluster runs its servers on loopback; --listen {listen} is not (run a cluster of your own: "
                        "jetstream/cluster/, and up --nats)")
    if address_file.exists() and port == "-1" and cluster == 1:
        old_host, _, old_port = address_file.read_text().strip().rpartition(":")
        if port_free(old_host, int(old_port)):
            host, port = old_host, old_port
        else:
            console.print(f"[yellow]port {old_port} of the previous session is taken: the server moves to a new port; "
                          "nodes joined by hand must be given the new address[/]")
    policies = recipe.policy_names
    tls = (
        None
        if is_loopback(host)
        else make_tls(rundir.credentials / "tls", [host if host not in ("0.0.0.0", "::") else socket.gethostname()])
    )
    nodes = tuple(f"rollout-{i}" for i in range(recipe.rollout.nodes))
    issue(rundir.credentials, rundir.run, policies, tls_ca_pem=tls.ca_pem if tls else None, nodes=nodes)
    tail = f'tls {{ cert_file: "{tls.cert_file}", key_file: "{tls.key_file}" }}\n' if tls else ""
    access = ServerAccess(rundir.credentials, rundir.run, policies, Scope(rundir.run, policies, (recipe.rollout.pool,)), tail)
    if cluster > 1:
        access.servers = start_cluster(rundir, access.config(), cluster, cores)
    else:
        server = EmbeddedServer(rundir.path, access.config(), listen=f"{host}:{port}", scheme="tls" if tls else "nats", cores=cores)
        access.servers = [server.start()]
        address_file.write_text(f"{host}:{server.port}")
    url = ",".join(s.url for s in access.servers)
    creds = issue(rundir.credentials, rundir.run, policies, url=url, tls_ca_pem=tls.ca_pem if tls else None)
    return access.servers, creds, access


def start_cluster(rundir: RunDir, config: str, size: int, cores: tuple[int, ...] | None) -> list[EmbeddedServer]:
    """``size`` servers forming one cluster, each with its store under ``RUN_DIR/nats/cluster/n{i}``, on the client and
    route ports of the previous session when they are free (kept in ``nats/cluster/ports.json``)."""
    base = rundir.nats / "cluster"
    base.mkdir(parents=True, exist_ok=True)
    kept = base / "ports.json"
    ports = [tuple(p) for p in json.loads(kept.read_text())] if kept.exists() else []
    if len(ports) != size or not all(port_free("127.0.0.1", p) for pair in ports for p in pair):
        ports = [(free_port(), free_port()) for _ in range(size)]
    kept.write_text(json.dumps(ports))
    members = cluster_members(base, size, config, [(int(c), int(r)) for c, r in ports], cores)
    for m in members:
        m.start()
    return members


def worker_command(rundir: RunDir, url: str, creds: dict[str, Credential] | None, spec: RoleSpec) -> list[str]:
    """The command line of a role process: no secret on it, only the path of its credential file."""
    cmd = [sys.executable, "-m", "astraflow.cli", "worker", spec.role, "--recipe", str(rundir.recipe), "--nats", url,
           "--run", rundir.run, "--id", spec.name]
    if creds is not None:
        path = rundir.credentials / f"{spec.name if spec.role == 'trainer' else spec.role}.json"
        if spec.role == "rollout" and node_path(rundir.credentials, spec.name).exists():
            path = node_path(rundir.credentials, spec.name)  # the node's own (a shared rollout.json: an external server's)
        cmd += ["--credential", str(path)]
    return [*cmd, *spec.args]


def join_command(rundir: RunDir, url: str, secured: bool) -> str:
    if secured:
        return (f"astraflow node add NAME --run-dir {rundir.path} && astraflow worker rollout --credential "
                f"{rundir.credentials / 'nodes' / 'NAME.json'} --recipe {rundir.recipe}")
    return f"astraflow worker rollout --recipe {rundir.recipe} --nats {redact(url)} --run {rundir.run}"


def role_specs(recipe: Recipe, rundir: RunDir, metrics_port_base: int | None, cores: list[int] | None = None) -> list[RoleSpec]:
    """``metrics_port_base``: fixed ports BASE+offset; 0: every role on a free port (listed in ``prometheus_targets.json``).
    ``cores``: the machine's usable CPUs (default: this process's)."""

    def metrics(offset: int) -> tuple[str, ...]:
        if metrics_port_base is None:
            return ()
        return ("--metrics-port", str(metrics_port_base + offset if metrics_port_base else 0))

    cores = usable_core_ids() if cores is None else cores
    shared = shared_cores(recipe, cores)
    every = tuple(cores) if shared is not None else None  # the launcher runs on the shared cores, its trainers may not
    specs = [RoleSpec(f"trainer-{p}", "trainer", ("--policy", p, "--checkpoint-dir", str(rundir.checkpoints(p)), *metrics(i)),
                      finishes=True, cores=every) for i, p in enumerate(recipe.policy_names)]  # pinned after the warm start
    # the others start there too and keep to the shared cores once started (``Role.started``)
    keep = ("--cores", ",".join(map(str, shared))) if shared is not None else ()
    specs.append(RoleSpec("dataflow", "dataflow", (*metrics(20), *keep), cores=every))
    if recipe.eval.enabled:
        specs.append(RoleSpec("evaluator", "evaluator", (*metrics(10), *keep), finishes=True, nice=recipe.rollout.nice, cores=every))
    specs += [RoleSpec(f"rollout-{i}", "rollout", (*metrics(30 + i), *keep), nice=recipe.rollout.nice, cores=every)
              for i in range(recipe.rollout.nodes)]
    return specs


GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")  # NVIDIA's driver, ROCm's, WSL's: CUDA needs one


def trains_on_accelerator(recipe: Recipe) -> bool:
    """Whether a trainer of ``recipe`` would train on an accelerator on this machine (then no core is its own: its step
    runs there, and the roles beside it, an SGLang server among them, keep every core)."""
    if not any(cfg.trainer.backend == "deepspeed" or cfg.trainer.device != "cpu" for cfg in recipe.policies.values()):
        return False
    if sys.platform == "linux" and not any(Path(node).exists() for node in GPU_DEVICE_NODES):
        return False  # no driver to reach one: torch, whose import costs the launcher seconds, is not asked
    import torch

    return torch.cuda.is_available()


def added_node(recipe: Recipe, specs: list[RoleSpec]) -> Callable[[str], RoleSpec]:
    """The spec of a rollout node ``--autoscale`` adds under a name: the first node's, renamed (its arguments, its
    CPU priority)."""
    first = next((s for s in specs if s.role == "rollout"), RoleSpec("rollout-0", "rollout", nice=recipe.rollout.nice))
    return lambda name: dataclasses.replace(first, name=name)


def prepare(recipe: Recipe, rundir: RunDir, resume: bool) -> Recipe:
    """Write the resolved recipe (a shared base warm-started and named as every policy's model,
    ``trainer.threads`` and ``sft.threads`` on ``auto`` made their shares of this machine's
    free cores, ``trainer.cores`` on ``auto`` the trainers' own cores or ``shared``); on resume show what changed
    against the stored one (and apply it)."""
    if resume and not rundir.exists():
        raise FileNotFoundError(f"{rundir.path} holds no recipe.yaml: not a run directory")
    if needs_base_warm_start(recipe):  # before any role starts: every policy adapts the one base (train/base_warm_start.py)
        held = held_key(rundir.file("base"))
        if resume and held is not None and held != base_key(recipe):
            raise RunFailed("the shared base's warm start changed (model, data, sft or seed), and the run's adapters were trained "
                            "on the base it has: resume with the warm start as it was, or start a new run")
        recipe = warm_shared_base(recipe, rundir.file("base"), console)
    recipe = with_thread_counts(recipe, usable_cores())
    recipe = with_core_plan(recipe, usable_core_ids(), trains_on_accelerator(recipe))
    rundir.prepare()
    if resume:
        old = yaml.safe_load(rundir.recipe.read_text())
        changes = recipe_diff(old, recipe.model_dump(mode="json", by_alias=True))  # as dump_recipe wrote it
        if changes:
            console.print("[bold]resuming with a changed recipe[/] (applied):\n  " + "\n  ".join(changes))
    dump_recipe(recipe, rundir.recipe)
    return recipe


def enforce(access: ServerAccess | None, sup: Supervisor, quarantined: Collection[str]) -> list[str]:
    """Apply the dataflow's quarantines: a node of this ``up`` that is cut off is stopped (not restarted: its credential
    no longer works) and started again once let back in; the server's users follow (``access.py``). What changed."""
    done = []
    for name, child in sup.children.items():
        if child.spec.role != "rollout":
            continue
        if name in quarantined and child.state in ("running", "backoff"):
            sup.retire(name)
            child.state = "quarantined"
            done.append(f"stopped {name}: quarantined")
    try:
        changes = access.sync(quarantined) if access is not None else []
    except (OSError, RuntimeError, TimeoutError) as e:  # the server's config not applied: tried again next turn
        changes = [f"[yellow]the server's users could not be updated ({type(e).__name__}: {e}); trying again[/]"]
    for name, child in list(sup.children.items()):
        if child.state == "quarantined" and name not in quarantined:
            sup.start(child.spec)
            done.append(f"started {name} again: let back in")
    return done + changes


def act(view: View, sup: Supervisor, watcher: RunWatcher, access: ServerAccess | None, pool: LocalPool | None) -> None:
    """A turn's local actions, each noted in the view: the supervisor's restarts, the dataflow's quarantines applied,
    the autoscale advice followed."""
    for event in sup.poll():
        view.note(f"[bold]supervisor[/]: {event}")
    for change in enforce(access, sup, watcher.live.quarantined):
        view.note(f"[bold red]access[/]: {change}")
    advice = watcher.live.advice
    if pool is not None and advice is not None and time.time() - advice.ts < 30:
        did = pool.act(advice.target, time.monotonic())
        if did:
            view.note(f"[bold]autoscale[/]: {did} — {advice.reason}")


class ServerKeeper:
    """The embedded servers supervised like roles: a member that exits (``kill -9``, a crash) is reaped and started
    again on its address with its store, so the roles reconnect (or ride on the other members of a cluster) and the
    run goes on; more than ``MAX_RESTARTS`` exits within ``WINDOW_S`` is a crash loop and fails the run."""

    MAX_RESTARTS, WINDOW_S = 5, 60.0

    def __init__(self, servers: list[EmbeddedServer], rundir: RunDir) -> None:
        self.servers = servers
        self.rundir = rundir
        self.exits: list[float] = []  # monotonic times of the servers' exits in this session
        self.failed: RunFailed | None = None  # a crash loop, or a server that did not start again (:meth:`check`)

    async def watch(self, view: View, every_s: float = 0.2) -> None:
        """:meth:`keep` every ``every_s`` seconds, apart from the launcher's loop, whose plane calls wait out their
        timeouts while a server is down (a kill was seen 11 s late that way). On the event loop's thread: a server dies
        with the thread that started it (PR_SET_PDEATHSIG), so not on a worker's."""
        while self.failed is None:
            try:
                self.keep(view)
            except RunFailed as e:
                self.failed = e
                return
            await asyncio.sleep(every_s)

    def check(self) -> None:
        """Raise what :meth:`watch` found the run cannot go on with."""
        if self.failed is not None:
            raise self.failed

    def keep(self, view: View) -> None:
        """Restart every server that has exited since the last call, noted in the view and in ``restarts.jsonl``."""
        for i, server in enumerate(self.servers):
            code = server.exited()
            if code is None:
                continue
            name = "nats-server" if len(self.servers) == 1 else f"nats-server-{i}"
            now = time.monotonic()
            self.exits = [t for t in self.exits if now - t < self.WINDOW_S] + [now]
            if len(self.exits) > self.MAX_RESTARTS:
                raise RunFailed(f"{name} exited {len(self.exits)} times within {self.WINDOW_S:.0f}s (last: {exit_text(code)}); "
                                f"see {server.run_dir / 'nats' / 'nats-server.log'}")
            try:
                server.restart()
            except (RuntimeError, TimeoutError) as e:
                raise RunFailed(f"{name} ended ({exit_text(code)}) and did not start again: {e}") from None
            view.note(f"[bold]supervisor[/]: {name} ended ({exit_text(code)}); restarted on {redact(server.url)} with its store")
            self.rundir.append("restarts.jsonl", {"session": len(self.rundir.sessions()), "role": name, "after": exit_text(code),
                                                  "ts": time.time()})


async def rest(stop: asyncio.Event, seconds: float) -> None:
    """Wait out what is left of the launcher's turn; at once when told to stop."""
    if seconds > 0:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)


@dataclasses.dataclass
class PlanePatience:
    """The plane may hiccup (a cluster member lost, a leader elected) and the run goes on; silent for ``limit`` seconds
    (``plane.server_gone_timeout``), the run is given up."""

    limit: float
    failing_since: float | None = None

    async def poll(self, watcher: RunWatcher, view: View) -> bool:
        """The watcher's turn; whether the run finished (False while the plane does not answer)."""
        try:
            await watcher.poll(0.5)
            finished = await watcher.finished()
        except Exception as e:  # nats-py raises its own timeouts and errors
            self.failing_since = self.failing_since or time.monotonic()
            if time.monotonic() - self.failing_since > self.limit:
                raise RunFailed(f"the plane has not answered the launcher for {self.limit:.0f}s: {type(e).__name__}: {e}") from None
            view.note(f"[yellow]plane: {type(e).__name__}: {e}; retrying[/]")
            await asyncio.sleep(1.0)
            return False
        self.failing_since = None
        return finished


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class EarlyStop:
    """A stop signal that comes after the session has begun and before the run's event loop holds the signals (the
    server starting, the topology made, the run read): noted, and acted on as soon as the loop runs, so the run still
    ends ``stopped`` with its summary and its session closed. The default action would end the launcher there, with no
    summary and the session never closed."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.signum = signum
        os.write(2, f"{signal.Signals(signum).name}: stopping as soon as the run is set up (then the summary)\n".encode())

    def hold(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self)


async def supervise(recipe: Recipe, rundir: RunDir, opts: NatsOptions, sup: Supervisor, specs: list[RoleSpec], timeout: float,
                    autoscale: bool, join: str, access: ServerAccess | None = None, servers: list[EmbeddedServer] | None = None,
                    early_stop: EarlyStop | None = None) -> str:
    """Start the roles and watch the run until it finishes; returns how it ended. ``servers``: the embedded one (or a
    cluster's), kept running (:class:`ServerKeeper`). ``early_stop``: where a stop signal that came before this loop
    was noted; the roles are then not started."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    if early_stop is not None and early_stop.signum is not None:
        stop.set()
    async with contextlib.AsyncExitStack() as leaving:  # undone in reverse: the signals held last, until the summary
        leaving.callback(hold_stop_signals, loop)
        plane = await Plane.connect(opts, rundir.run, "launcher", wait=30)
        leaving.push_async_callback(plane.close)
        await plane.ensure_topology(recipe.topology())  # before any role: they only look for it (a fresh cluster: waits for it)
        watcher = RunWatcher(plane, recipe, rundir, set(eval_versions(recipe)) if recipe.eval.enabled else set(), eval_subjects(recipe))
        await watcher.start()
        leaving.push_async_callback(watcher.stop)
        await watcher.read_dataflow()  # a resumed run: the nodes quarantined before stay out from the start
        if stop.is_set():  # told to stop before any role started
            return "stopped"
        return await watch(recipe, rundir, watcher, sup, specs, timeout, autoscale, join, access, servers, stop)


async def watch(recipe: Recipe, rundir: RunDir, watcher: RunWatcher, sup: Supervisor, specs: list[RoleSpec], timeout: float,
                autoscale: bool, join: str, access: ServerAccess | None, servers: list[EmbeddedServer] | None, stop: asyncio.Event) -> str:
    """Start the roles, then watch the run until it finishes or ``stop`` is set."""
    early = enforce(access, sup, watcher.live.quarantined)
    for spec in specs:
        sup.start(spec)
    pool = LocalPool(sup, added_node(recipe, specs), max_nodes=recipe.dataflow.autoscale.max_nodes) if autoscale else None
    started = time.monotonic()
    patience = PlanePatience(recipe.plane.server_gone_timeout)
    keeper = ServerKeeper(servers or [], rundir)
    keeping: asyncio.Task[None] | None = None
    trained = False
    try:
        with View(recipe, console, join) as view:
            for change in early:
                view.note(f"[bold red]access[/]: {change}")
            keeping = asyncio.create_task(keeper.watch(view))
            while not stop.is_set():
                began = time.monotonic()
                keeper.check()
                finished = await patience.poll(watcher, view)
                if watcher.trained and not trained:
                    trained, pool = True, None  # no node is started any more
                    view.note(f"[bold]supervisor[/]: every trainer is done: {trained_all(sup, specs)}")
                act(view, sup, watcher, access, pool)
                view.update(watcher.live, sup.restarts, watcher.run_time(), local_nodes=len(sup.live("rollout")))
                if finished:
                    await watcher.record_accounting(wait=2 * HEARTBEAT_PERIOD_S)  # the last announcements accounted
                    return "finished"
                if time.monotonic() - started > timeout:
                    with contextlib.suppress(Exception):  # what the dataflow accounts, for the summary of a stalled run
                        await watcher.record_accounting()
                    session = len(rundir.sessions())
                    raise RunFailed(f"run did not finish in {timeout:.0f}s",
                                    stall_report(watcher.live, {s.name: rundir.log(s.name, session) for s in specs}))
                await rest(stop, LAUNCHER_TURN_S - (time.monotonic() - began))
            with contextlib.suppress(Exception):  # told to stop: the summary says what could be read
                await watcher.record_accounting()
            return "stopped"
    finally:
        if keeping is not None:
            await cancel_and_wait(keeping)


def trained_all(sup: Supervisor, specs: list[RoleSpec]) -> str:
    """Every trainer is done, and nothing a node makes from now on is trained: every local node is told to leave
    (SIGTERM: it drains what it holds), and the evaluator, kept to the cores the trainers left while they trained, runs
    its last evaluations on every core. What was done, for the view."""
    nodes = [c.name for c in sup.live("rollout")]
    for name in nodes:
        sup.retire(name)
    done = [f"{', '.join(nodes)} leave"] if nodes else []
    every = next((s.cores for s in specs if s.role == "evaluator" and s.cores is not None), None)  # None: it was not kept
    if every is not None and sup.widen("evaluator", every):
        done.append(f"the evaluator runs on CPUs {list(every)}")
    return "; ".join(done) or "nothing to change"


def hold_stop_signals(loop: asyncio.AbstractEventLoop) -> None:
    """The run is stopping: a stop signal from here until the summary is written is noted, not fatal. ``timeout`` sends
    its SIGTERM twice (to the launcher, then to its group), a process manager may send it again, a user may press Ctrl-C
    again; the default action would end the launcher mid-drain, with no summary and its session never closed. The
    event loop's handlers are swapped for this one with those signals blocked, so none lands on the default between."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
            signal.signal(sig, _already_stopping)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _already_stopping(signum: int, frame: object) -> None:
    os.write(2, f"{signal.Signals(signum).name}: already stopping (the roles drain, then the summary)\n".encode())


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def session_cpu(sup: Supervisor, at_start: tuple[float, float], embedded: bool) -> dict[str, float]:
    """CPU seconds of this session per process: each role (``wait4`` of every instance), the launcher, and the
    embedded nats-server (what the launcher's reaped children used beyond its roles)."""
    roles = sup.cpu_s
    cpu = {**roles, "launcher": round(cpu_seconds(resource.RUSAGE_SELF) - at_start[0], 2)}
    if embedded:
        cpu["nats-server"] = round(max(0.0, cpu_seconds(resource.RUSAGE_CHILDREN) - at_start[1] - sum(roles.values())), 2)
    return cpu


def banner(recipe: Recipe, run: str, session: int, url: str, embedded: bool, shared: Collection[int] | None) -> None:
    """The run's first lines: which run, which session, on which server; where the roles run when the trainers have
    cores of their own."""
    where = "embedded, authenticated" if embedded else "external"
    console.print(f"[bold]AstraFlow[/] run [cyan]{run}[/] (session {session}) on {redact(url)} ({where} nats-server)")
    if shared is not None:
        own = ", ".join(f"trainer {p} on CPUs {cfg.trainer.cores}" for p, cfg in recipe.policies.items()
                        if isinstance(cfg.trainer.cores, list))
        console.print(f"cores: {own} once warm-started; every other role on CPUs {list(shared)} once started (trainer.cores)")


def external_plane(rundir: RunDir, url: str, credentials: Path | None) -> tuple[dict[str, Credential] | None, NatsOptions]:
    """An existing server or cluster at ``url``: the role credential files given for it (``credentials``, with the nodes'
    own under ``nodes/``) copied into the run directory, and how the launcher connects (as admin when there are any)."""
    if credentials is None:
        return None, NatsOptions(url=url)
    creds = {p.stem: Credential.read(p) for p in credentials.glob("*.json")}
    rundir.credentials.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name, c in creds.items():
        c.write(rundir.credentials / f"{name}.json")
    for p in credentials.glob("nodes/*.json"):  # the nodes' own, as the server was given them
        Credential.read(p).write(node_path(rundir.credentials, p.stem))
    opts = NatsOptions.from_credential(str(rundir.credentials / "admin.json"), url=url) if creds else NatsOptions(url=url)
    return creds, opts


def clustered(recipe: Recipe, rundir: RunDir, nats_url: str | None, cluster: int, resume: bool) -> tuple[Recipe, int]:
    """How many embedded servers the run has (a resumed run keeps its size), and the recipe with its streams replicated
    on up to three of them."""
    if cluster > 1 and nats_url is not None:
        raise RunFailed(f"--cluster {cluster} starts embedded servers; --nats names servers of your own (drop one of them)")
    kept = rundir.nats / "cluster" / "ports.json"
    if resume and kept.exists():
        cluster = len(json.loads(kept.read_text()))
    if cluster > 1 and nats_url is None and recipe.plane.replicas == 1:
        recipe = recipe.model_copy(update={"plane": recipe.plane.model_copy(update={"replicas": min(3, cluster)})})
    return recipe, cluster


def open_plane(rundir: RunDir, recipe: Recipe, nats_url: str | None, listen: str | None, shared: tuple[int, ...] | None,
               cluster: int, credentials: Path | None
               ) -> tuple[list[EmbeddedServer], ServerAccess | None, dict[str, Credential] | None, NatsOptions, str]:
    """The run's plane: the embedded server(s) started (their access control, the role credentials, the admin's
    options, the URL), or the server at ``nats_url`` with the credentials given for it."""
    if nats_url is not None:
        creds, opts = external_plane(rundir, nats_url, credentials)
        return [], None, creds, opts, nats_url
    servers, creds, access = start_server(rundir, recipe, listen, shared, cluster)
    return servers, access, creds, NatsOptions.from_credential(str(rundir.credentials / "admin.json")), ",".join(s.url for s in servers)


def up(recipe: Recipe, run_dir: Path, nats_url: str | None = None, timeout: float = 3600.0, autoscale: bool = False,
       resume: bool = False, metrics_port_base: int | None = None, listen: str | None = None,
       credentials: Path | None = None, cluster: int = 1) -> dict[str, Any]:
    """Run ``recipe`` in ``run_dir`` (or continue it: ``resume``); returns the summary.

    ``nats_url``: an existing server or cluster instead of the embedded one (``credentials``: a
    directory of role credential files for it, as ``up`` writes them). ``listen``: where the
    embedded server listens (default loopback, a free port; beyond loopback, TLS). ``cluster``: that
    many embedded servers on loopback forming one JetStream cluster, the run's streams replicated on
    (up to) three of them; a resumed run keeps the size it had."""
    rundir = RunDir(Path(run_dir))
    recipe, cluster = clustered(recipe, rundir, nats_url, cluster, resume)
    recipe = prepare(recipe, rundir, resume)  # a shared base's warm start, before the run's time and CPU count (its own record)
    cpu_at_start = cpu_seconds(resource.RUSAGE_SELF), cpu_seconds(resource.RUSAGE_CHILDREN)
    cores = usable_core_ids()
    shared = shared_cores(recipe, cores)
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}  # a caller of up() from Python gets them back
    early_stop = EarlyStop()
    early_stop.hold()  # from the session's start: a stop signal ends it through the summary, not mid-setup
    session = rundir.begin_session()
    servers: list[EmbeddedServer] = []
    sup: Supervisor | None = None
    outcome, summary = "failed", {}
    try:
        if shared is not None:  # the launcher too, and what it starts unless told otherwise (until up returns)
            pin(shared)
        servers, access, creds, opts, url = open_plane(rundir, recipe, nats_url, listen, shared, cluster, credentials)
        banner(recipe, rundir.run, session, url, bool(servers), shared)

        def record_restart(child: Child) -> None:
            rundir.append("restarts.jsonl", {"session": session, "role": child.name, "after": exit_text(child.last_exit),
                                             "ts": time.time()})

        def command(spec: RoleSpec) -> list[str]:
            if access is not None and spec.role == "rollout":
                access.let_in(spec.name)  # a node --autoscale adds gets its own credential, known to the server before it starts
            return worker_command(rundir, url, creds, spec)

        sup = Supervisor(command, lambda name: rundir.log(name, session),
                         env={k: v for k, v in os.environ.items() if k != "NATS_PASSWORD"}, on_restart=record_restart)
        specs = role_specs(recipe, rundir, metrics_port_base, cores)
        outcome = run_event_loop(supervise(recipe, rundir, opts, sup, specs, timeout, autoscale,
                                         join_command(rundir, url, creds is not None), access, servers, early_stop))
    except CrashLoop as e:
        outcome = f"crash loop: {e.child.name}"
        raise RunFailed(str(e)) from None
    except RunFailed as e:
        outcome = e.why
        raise
    finally:
        if sup is not None:
            sup.stop(timeout=recipe.rollout.drain_timeout + 5)
        for server in servers:
            server.stop()
        restarts, cpu = (sup.restarts, session_cpu(sup, cpu_at_start, embedded=bool(servers))) if sup else ({}, {})
        rundir.end_session(session, outcome, restarts, cpu)
        with contextlib.suppress(Exception):  # the summary is best effort on the way out of a failure
            summary = summarize(recipe, rundir, console, outcome)
        if shared is not None:  # a caller of up() from Python gets its cores back
            pin(cores)
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
    return summary


def new_run_dir(recipe: Recipe, base: Path = Path("runs")) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return base / f"{recipe.name}-{stamp}-{os.getpid() % 10000}"
