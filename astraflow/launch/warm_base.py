"""The shared base's warm start as ``astraflow up`` and ``astraflow warm-start`` run it: a progress bar around
``train/base_warm_start.py``, and the recipe every role then reads."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from astraflow.config import Recipe
from astraflow.train.base_warm_start import on_base, warm_base
from astraflow.train.threads import threads_for


def warm_shared_base(recipe: Recipe, base: Path, console: Console) -> Recipe:
    """Warm-start the base every policy shares into ``base`` (kept when it is there for this recipe already) and
    return ``recipe`` on it."""
    threads = threads_for(recipe.policies[recipe.primary].sft.threads)
    columns = (TextColumn("[bold]shared base warm start[/] ({task.fields[threads]} threads)"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("warm start", total=None, threads=threads)
        trained = warm_base(recipe, base, threads, lambda done, total: bar.update(task, completed=done, total=total))
    console.print(f"shared base: {'warm-started into' if trained else 'reusing the warm start in'} {base} "
                  "(every policy's model.pretrained; sft.steps 0)")
    return on_base(recipe, base)
