"""The ``astraflow`` command: up, worker, status, warm-start, region, node. Heavy modules are imported lazily."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="AstraFlow: dataflow-oriented RL on a NATS JetStream plane.")

NatsUrl = typer.Option(None, "--nats", help="URL of an existing nats-server or cluster (comma-separated); default: embedded.")
Overrides = typer.Option([], "--set", help="Recipe override, e.g. --set trainer.steps=20 (repeatable).")


def _load(recipe: str, overrides: list[str]):
    from astraflow.config import RecipeError, load_recipe

    try:
        return load_recipe(recipe, overrides)
    except RecipeError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None


def _opts(nats: str | None, credential: str | None, user: str | None = None, password: str | None = None, creds: str | None = None,
          nkey: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
          domain: str | None = None):
    from astraflow.streams.plane import NatsOptions

    tls = {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key, "domain": domain, "creds": creds, "nkey_seed": nkey}
    if credential:
        return NatsOptions.from_credential(credential, url=nats, **tls)
    if not nats:
        typer.echo("give --nats URL (or --credential FILE, which names the server)", err=True)
        raise typer.Exit(2)
    return NatsOptions(url=nats, user=user, password=password, **tls)


Credential = typer.Option(None, "--credential", help="Credential file written by `astraflow up` (RUN_DIR/credentials/ROLE.json): "
                                                     "user, password, run id, server URL and CA; no secret on the command line.")
RunId = typer.Option(None, "--run", "--run-id", help="Run id (subject scope; default: the credential's); --run-id under torchrun, "
                                                      "whose parser takes --run for --run-path.")
CheckpointDir = typer.Option(None, help="Trainer: checkpoint directory of this policy; a restart resumes from it (default: none, "
                                        "start at v0).")
FreshLineage = typer.Option(False, "--fresh-lineage", help="Trainer: start over from the initial weights as a new weight lineage, "
                            "announced after the plane's newest version (never reusing a version number); without it a trainer "
                            "refuses to start behind the plane unless its checkpoint restores it.")


@app.command()
def up(
    recipe: str | None = typer.Argument(None, help="Recipe YAML or folder (e.g. recipes/arithmetic). With --resume: applied, "
                                                      "the differences shown."),
    nats: str | None = NatsUrl,
    run_dir: Path | None = typer.Option(None, help="Run directory (default runs/NAME-TIMESTAMP)."),
    resume: Path | None = typer.Option(None, "--resume", help="Continue the run kept in this run directory (same address, "
                                                                "credentials, checkpoints, state and history)."),
    set_: list[str] = Overrides,
    timeout: float = typer.Option(3600.0, help="Abort the run after this many seconds."),
    autoscale: bool = typer.Option(False, "--autoscale", metavar="", show_default=False,
                                   help="Start and retire local rollout workers toward the dataflow's advised pool size."),
    metrics_port_base: int | None = typer.Option(None, help="Serve Prometheus metrics from every role: trainers on BASE+i, "
                                                               "evaluator BASE+10, dataflow BASE+20, rollout nodes BASE+30+i; "
                                                               "0: each on a free port. Either way RUN_DIR/prometheus_targets.json "
                                                               "lists them (Prometheus file_sd)."),
    listen: str | None = typer.Option(None, help="Where the embedded server listens, HOST:PORT (default 127.0.0.1, a free port). "
                                                    "Beyond loopback, TLS is on and the credential files carry the CA."),
    credentials: Path | None = typer.Option(None, help="With --nats: a directory of role credential files for that server."),
    cluster: int = typer.Option(1, min=1, max=5, help="Embedded servers forming one JetStream cluster on loopback (3: the "
                                                        "run's streams replicated on all three; any one may die and return)."),
) -> None:
    """Start the embedded server (or use --nats) and every role as a supervised process; watch; summarise."""
    from astraflow.launch import RunFailed, new_run_dir
    from astraflow.launch import up as run_up
    from astraflow.runtime import setup_logging, tune_gc

    setup_logging("WARNING")
    tune_gc()
    try:
        if resume is not None:
            r = _load(recipe or str(resume / "recipe.yaml"), set_)
            run_up(r, resume, nats, timeout, autoscale, resume=True, metrics_port_base=metrics_port_base, listen=listen,
                   credentials=credentials, cluster=cluster)
            return
        if recipe is None:
            typer.echo("give a RECIPE, or --resume RUN_DIR", err=True)
            raise typer.Exit(2)
        r = _load(recipe, set_)
        run_up(r, run_dir or new_run_dir(r), nats, timeout, autoscale, metrics_port_base=metrics_port_base, listen=listen,
               credentials=credentials, cluster=cluster)
    except (RunFailed, FileNotFoundError, PermissionError, ConnectionError) as e:
        typer.echo(f"astraflow up: {e}", err=True)
        raise typer.Exit(1) from None


@app.command()
def worker(
    role: str = typer.Argument(..., help="dataflow | rollout | trainer | evaluator"),
    recipe: str = typer.Option(..., help="Recipe YAML (the run directory's recipe.yaml)."),
    nats: str | None = typer.Option(None, help="nats URL(s) of the run's plane (default: the credential's)."),
    run: str | None = RunId,
    credential: str | None = Credential,
    id: str | None = typer.Option(None, "--id", help="Worker id (default: ROLE-PID)."),
    policy: str | None = typer.Option(None, help="Trainer: the policy to train (default: the first)."),
    pool: str | None = typer.Option(None, help="Rollout pool (shared durable consumer)."),
    region: str | None = typer.Option(None, help="Rollout: region label of this node (default: rollout.region)."),
    hardware: str | None = typer.Option(None, help="Rollout: hardware label (default: rollout.hardware, else cuda/cpu as detected)."),
    weights_domain: str | None = typer.Option(None, help="Rollout: read weights from the mirrors in this JetStream domain (a leaf)."),
    user: str | None = typer.Option(None, help="User name; the password comes from $NATS_PASSWORD (never put it on a command line)."),
    creds: str | None = None,
    nkey: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    domain: str | None = typer.Option(None, help="JetStream domain to read (a region's leafnode)."),
    checkpoint_dir: Path | None = CheckpointDir,
    metrics_port: int | None = typer.Option(None, help="Serve Prometheus metrics on this port (0: a free one, logged; default: none)."),
    cores: str | None = typer.Option(None, help="Run on these CPUs (e.g. 0,1) once started; the start-up may use any "
                                     "(a trainer: trainer.cores)."),
    fresh_lineage: bool = FreshLineage,
    set_: list[str] = Overrides,
) -> None:
    """Run one role in this process (join a run from any machine that reaches the plane). Each role takes the flags of its
    own options (``astraflow.role``: NodeOptions, TrainerOptions); another role's flag is refused by name."""
    import os

    from astraflow.runtime import run_event_loop, setup_logging, tune_gc, tune_malloc

    setup_logging()
    if role not in ROLES:
        typer.echo(f"unknown role {role!r}: {' | '.join(ROLES)}", err=True)
        raise typer.Exit(2)
    r = _load(recipe, set_)
    opts = _opts(nats, credential, user, None, creds, nkey, tls_ca, tls_cert, tls_key, domain)
    run = run or opts.run
    if not run:
        typer.echo("give --run RUN (or --credential FILE, which names the run)", err=True)
        raise typer.Exit(2)
    own = {"policy": policy, "checkpoint_dir": checkpoint_dir, "fresh_lineage": fresh_lineage or None, "pool": pool,
           "region": region, "hardware": hardware, "weights_domain": weights_domain}
    options = _role_options(role, nats=opts, run=run, worker_id=id or f"{role}-{os.getpid()}", metrics_port=metrics_port,
                            cores=_cpu_list(cores), **{k: v for k, v in own.items() if v is not None})
    tune_gc()
    tune_malloc()
    run_event_loop(_serve(role, r, options))


ROLES = ("dataflow", "rollout", "trainer", "evaluator")


def _cpu_list(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(c) for c in text.split(","))
    except ValueError:
        typer.echo(f"--cores: {text!r} is not a list of CPU numbers such as 0,1", err=True)
        raise typer.Exit(2) from None


def _role_options(role: str, **given: Any):
    """The role's option model from the flags given; a flag of another role, or a bad value, fails with its name."""
    from pydantic import ValidationError

    from astraflow.role import options_for

    try:
        return options_for(role)(**given)
    except ValidationError as e:
        for err in e.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            flag = "--" + field.replace("_", "-")
            if err["type"] == "extra_forbidden":
                owners = [r for r in ROLES if field in options_for(r).model_fields]
                typer.echo(f"{flag} is an option of the {' and '.join(owners)} role, not of {role}", err=True)
            else:
                typer.echo(f"{flag}: {err['msg']}", err=True)
        raise typer.Exit(2) from None


def _serve(role: str, recipe: Any, options: Any) -> Coroutine[Any, Any, None]:
    if role == "dataflow":
        from astraflow.dataflow.service import serve
        return serve(recipe, options)
    if role == "trainer":
        from astraflow.train.worker import serve as serve_trainer
        return serve_trainer(recipe, options)
    if role == "rollout":
        from astraflow.rollout.node import serve as serve_rollout
        return serve_rollout(recipe, options)
    from astraflow.rollout.evaluator import serve as serve_eval
    return serve_eval(recipe, options)


@app.command()
def status(
    nats: str | None = typer.Option(None, help="nats URL of the run's plane (default: the credential's)."),
    run: str | None = typer.Option(None, help="Run id (default: the credential's)."),
    credential: str | None = Credential,
    user: str | None = typer.Option(None, help="User name; the password comes from $NATS_PASSWORD."),
    policy: str | None = typer.Option(None, help="Policy to report (default: the first with a version)."),
    timeout: float = typer.Option(5.0, help="Give up on an unreachable server after this many seconds."),
) -> None:
    """Streams, lag, workers (dead ones marked), policy version and task accounting of a live run."""
    from astraflow.status import NoSuchRun, show

    opts = _opts(nats, credential, user)
    run = run or opts.run
    if not run:
        typer.echo("give --run RUN (or --credential FILE, which names the run)", err=True)
        raise typer.Exit(2)
    try:
        asyncio.run(show(opts, run, policy, timeout))
    except NoSuchRun as e:
        typer.echo(f"astraflow status: {e}", err=True)
        raise typer.Exit(3) from None
    except (ConnectionError, PermissionError) as e:
        typer.echo(f"astraflow status: {e}", err=True)
        raise typer.Exit(2) from None


@app.command("warm-start")
def warm_start(
    recipe: str = typer.Argument(..., help="Recipe YAML or folder whose policies share one base (rollout.shared_base)."),
    out: Path = typer.Option(..., help="Model directory to write the warm-started base into (kept if it holds it already)."),
    set_: list[str] = Overrides,
) -> None:
    """Warm-start the base every policy of a shared-base recipe adapts (`astraflow up` does it itself). Then start every
    role with --set model.pretrained=OUT --set sft.steps=0."""
    from rich.console import Console

    from astraflow.launch.warm_base import warm_shared_base
    from astraflow.runtime import setup_logging
    from astraflow.train.base_warm_start import needs_base_warm_start

    setup_logging("WARNING")
    r = _load(recipe, set_)
    if not needs_base_warm_start(r):
        typer.echo("astraflow warm-start: the recipe shares no base (rollout.shared_base) or no policy warm-starts (sft.steps)",
                   err=True)
        raise typer.Exit(2)
    try:
        warm_shared_base(r, out, Console())
    except FileExistsError as e:
        typer.echo(f"astraflow warm-start: {e}", err=True)
        raise typer.Exit(2) from None


region_app = typer.Typer(no_args_is_help=True, help="Regions: leafnode servers that mirror a run's weights.")
app.add_typer(region_app, name="region")


@region_app.command("mirrors")
def region_mirrors(
    nats: str | None = typer.Option(None, help="URL of the region's leaf server."),
    run: str | None = typer.Option(None, help="Run id (default: the credential's)."),
    credential: str | None = Credential,
    user: str | None = typer.Option(None, help="User name; the password comes from $NATS_PASSWORD."),
    hub_domain: str = typer.Option("hub", help="JetStream domain the mirrors copy: the hub's (where the trainer publishes), "
                                               "or for a relay its region leaf's."),
    leaf_domain: str | None = typer.Option(None, help="JetStream domain of the leaf to make the mirrors in (default: the leaf's own)."),
    weights_history: int = typer.Option(64, help="Announcements kept per policy in the mirror (the recipe's plane.weights_history)."),
    timeout: float = typer.Option(30.0, help="Give up when the hub domain does not answer through the leaf in this many seconds."),
) -> None:
    """Make (idempotently) the region's mirrors of a run's weights: its announcements and its payload bucket.
    Then give the trainer `plane.mirror_domains: [LEAF_DOMAIN]` and start region nodes with
    `astraflow worker rollout --nats LEAF_URL --domain HUB_DOMAIN --weights-domain LEAF_DOMAIN`."""
    from astraflow.streams.objects import ensure_region_mirrors
    from astraflow.streams.plane import Plane

    opts = _opts(nats, credential, user, domain=hub_domain)
    run = run or opts.run
    if not run:
        typer.echo("give --run RUN (or --credential FILE, which names the run)", err=True)
        raise typer.Exit(2)

    async def make() -> None:
        plane = await Plane.connect(opts, run, "region-setup", wait=timeout)
        try:
            await plane.wait_for_domain(hub_domain, timeout=timeout)
            mirrors = await ensure_region_mirrors(plane, run, hub_domain=hub_domain, leaf_domain=leaf_domain,
                                                  weights_history=weights_history)
            typer.echo(f"mirrors ready: {mirrors}")
        finally:
            await plane.close()

    try:
        asyncio.run(make())
    except (TimeoutError, ConnectionError, PermissionError, RuntimeError) as e:
        typer.echo(f"astraflow region mirrors: {e}", err=True)
        raise typer.Exit(1) from None


node_app = typer.Typer(no_args_is_help=True, help="Rollout nodes of a run: their own credentials, quarantine and re-admission.")
app.add_typer(node_app, name="node")
RunDirArg = typer.Option(..., "--run-dir", help="The run's directory (it holds credentials/admin.json).")


@node_app.command("add")
def node_add(name: str = typer.Argument(..., help="The node's name ([A-Za-z0-9_-]; its trajectories' subject)."),
             run_dir: Path = RunDirArg) -> None:
    """Issue a node its own credential; the running `up` lets it in. Hand the file to the node's machine:
    `astraflow worker rollout --credential NAME.json --recipe recipe.yaml`."""
    from astraflow.launch import nodes

    try:
        path = nodes.add(run_dir, name)
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"astraflow node add: {e}", err=True)
        raise typer.Exit(2) from None
    let_in = asyncio.run(nodes.served(path))
    if let_in is None:
        typer.echo("no server answers at the run's address now: the node is let in once `astraflow up` runs it", err=True)
    elif not let_in:
        typer.echo("the server has not let the node in: is `astraflow up` running this run directory?", err=True)
    typer.echo(path)


@node_app.command("revoke")
def node_revoke(name: str = typer.Argument(..., help="The node's name."), run_dir: Path = RunDirArg) -> None:
    """Delete a node's credential for good: the running `up` takes it off its server (its connection is closed)."""
    from astraflow.launch import nodes

    try:
        if not nodes.revoke(run_dir, name):
            typer.echo(f"astraflow node revoke: no node {name!r} in {run_dir}", err=True)
            raise typer.Exit(1)
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"astraflow node revoke: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"revoked {name}")


@node_app.command("admit")
def node_admit(name: str = typer.Argument(..., help="The quarantined node's name."), run_dir: Path = RunDirArg) -> None:
    """Let a quarantined node back in: the dataflow takes its trajectories again, `up` gives it its credential back."""
    from astraflow.launch import nodes

    try:
        q = asyncio.run(nodes.admit(run_dir, name))
    except (FileNotFoundError, ValueError, ConnectionError, PermissionError) as e:
        typer.echo(f"astraflow node admit: {e}", err=True)
        raise typer.Exit(2) from None
    if q is None:
        typer.echo(f"astraflow node admit: {name!r} is not quarantined", err=True)
        raise typer.Exit(1)
    typer.echo(f"admitted {name} (quarantined for {q.summary()})")


@node_app.command("list")
def node_list(run_dir: Path = RunDirArg) -> None:
    """The run's nodes with a credential; the quarantined ones with why."""
    from astraflow.launch import nodes

    try:
        names, quarantined = asyncio.run(nodes.standing(run_dir))
    except (FileNotFoundError, ValueError, ConnectionError, PermissionError) as e:
        typer.echo(f"astraflow node list: {e}", err=True)
        raise typer.Exit(2) from None
    for name in sorted({*names, *quarantined}):
        q = quarantined.get(name)
        typer.echo(f"{name}\t" + (f"quarantined: {q.summary()} (last: {q.reason})" if q else "ok"))


def main() -> None:
    app()


def worker_main() -> None:
    sys.argv.insert(1, "worker")
    app()


if __name__ == "__main__":
    main()
