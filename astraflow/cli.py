"""The ``astraflow`` command: up, worker, status. Heavy modules are imported lazily."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="AstraFlow: dataflow-oriented RL on a NATS JetStream plane.")

NatsUrl = typer.Option(None, "--nats", help="URL of an existing nats-server or cluster (comma-separated); default: embedded.")
Overrides = typer.Option([], "--set", help="Recipe override, e.g. --set trainer.steps=20 (repeatable).")


def _load(recipe: str, overrides: list[str]):  # noqa: ANN202
    from astraflow.config import RecipeError, load_recipe

    try:
        return load_recipe(recipe, overrides)
    except RecipeError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None


def _opts(nats: str, user: str | None, password: str | None, creds: str | None, nkey: str | None,
          tls_ca: str | None, tls_cert: str | None, tls_key: str | None, domain: str | None):  # noqa: ANN202
    from astraflow.streams.plane import NatsOptions

    return NatsOptions(url=nats, user=user, password=password, creds=creds, nkey_seed=nkey, tls_ca=tls_ca,
                       tls_cert=tls_cert, tls_key=tls_key, domain=domain)


@app.command()
def up(
    recipe: Optional[str] = typer.Argument(None, help="Recipe YAML or folder (e.g. recipes/arithmetic)."),
    nats: Optional[str] = NatsUrl,
    run_dir: Optional[Path] = typer.Option(None, help="Run directory (default runs/NAME-TIMESTAMP)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run kept in this run directory."),
    set_: list[str] = Overrides,
    timeout: float = typer.Option(3600.0, help="Abort the run after this many seconds."),
    autoscale: bool = typer.Option(False, "--autoscale", help="Start and retire local rollout workers toward the dataflow's advised pool size."),
    metrics_port_base: Optional[int] = typer.Option(None, help="Serve Prometheus metrics from every role: trainers on BASE+i, evaluator BASE+10, dataflow BASE+20, rollout nodes BASE+30+i (observability/prometheus.yml uses 9400)."),
) -> None:
    """Start the embedded server (or use --nats) and every role as a process; watch; summarise."""
    from astraflow.launcher import new_run_dir, up as run_up
    from astraflow.runtime import setup_logging

    setup_logging("WARNING")
    if resume is not None:
        r = _load(str(resume / "recipe.yaml"), set_)
        run_up(r, resume, nats, timeout, autoscale, resume=True, metrics_port_base=metrics_port_base)
        return
    if recipe is None:
        typer.echo("give a RECIPE, or --resume RUN_DIR", err=True)
        raise typer.Exit(2)
    r = _load(recipe, set_)
    run_up(r, run_dir or new_run_dir(r), nats, timeout, autoscale, metrics_port_base=metrics_port_base)


@app.command()
def worker(
    role: str = typer.Argument(..., help="dataflow | rollout | trainer | evaluator"),
    recipe: str = typer.Option(..., help="Recipe YAML (the run directory's recipe.yaml)."),
    nats: str = typer.Option(..., help="nats URL(s) of the run's plane."),
    run: str = typer.Option(..., help="Run id (subject scope)."),
    id: Optional[str] = typer.Option(None, "--id", help="Worker id (default: ROLE-PID)."),
    policy: Optional[str] = typer.Option(None, help="Trainer: the policy to train (default: the first)."),
    pool: Optional[str] = typer.Option(None, help="Rollout pool (shared durable consumer)."),
    region: Optional[str] = typer.Option(None, help="Rollout: region label of this node (default: rollout.region)."),
    hardware: Optional[str] = typer.Option(None, help="Rollout: hardware label of this node (default: rollout.hardware, else cuda/cpu as detected)."),
    weights_domain: Optional[str] = typer.Option(None, help="Rollout: read weights from the mirrors in this JetStream domain (a region's leaf)."),
    user: Optional[str] = None, password: Optional[str] = None, creds: Optional[str] = None, nkey: Optional[str] = None,
    tls_ca: Optional[str] = None, tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
    domain: Optional[str] = typer.Option(None, help="JetStream domain to read (a region's leafnode)."),
    checkpoint_dir: Optional[Path] = typer.Option(None, help="Trainer: checkpoint directory of this policy; a restart resumes from it (default: none, start at v0)."),
    metrics_port: Optional[int] = typer.Option(None, help="Serve Prometheus metrics on this port (0: a free one, logged; default: none)."),
    fresh_lineage: bool = typer.Option(False, "--fresh-lineage", help=(
        "Trainer: start over from the initial weights as a new weight lineage, announced after the plane's newest version "
        "(never reusing a version number); without it a trainer refuses to start behind the plane unless its checkpoint restores it.")),
    set_: list[str] = Overrides,
) -> None:
    """Run one role in this process (join a run from any machine that reaches the plane)."""
    import os

    from astraflow.runtime import setup_logging

    setup_logging()
    r = _load(recipe, set_)
    opts = _opts(nats, user, password, creds, nkey, tls_ca, tls_cert, tls_key, domain)
    wid = id or f"{role}-{os.getpid()}"
    if role == "dataflow":
        from astraflow.dataflow.service import serve
        asyncio.run(serve(r, opts, run, wid, metrics_port))
    elif role == "trainer":
        from astraflow.train.worker import serve as serve_trainer
        asyncio.run(serve_trainer(r, opts, run, wid, policy, checkpoint_dir, metrics_port, fresh_lineage))
    elif role == "rollout":
        from astraflow.rollout.worker import serve as serve_rollout
        if weights_domain:
            r = r.model_copy(update={"rollout": r.rollout.model_copy(update={"weights_domain": weights_domain})})
        asyncio.run(serve_rollout(r, opts, run, wid, pool, region, hardware, metrics_port))
    elif role == "evaluator":
        from astraflow.rollout.evaluator import serve as serve_eval
        asyncio.run(serve_eval(r, opts, run, wid, metrics_port))
    else:
        typer.echo(f"unknown role {role!r}: dataflow | rollout | trainer | evaluator", err=True)
        raise typer.Exit(2)


@app.command()
def status(
    nats: str = typer.Option(..., help="nats URL of the run's plane."),
    run: str = typer.Option(..., help="Run id."),
    policy: str = typer.Option("solver", help="Policy to report."),
) -> None:
    """Streams, lag, workers, policy version and task accounting of a live run."""
    from astraflow.status import show

    asyncio.run(show(nats, run, policy))


def main() -> None:
    app()


def worker_main() -> None:
    sys.argv.insert(1, "worker")
    app()


if __name__ == "__main__":
    main()
