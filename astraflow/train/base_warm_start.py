"""The warm start of a shared base (``rollout.shared_base``).

Every policy's adapters sit on one base model, so the SFT warm start is the base's: every weight trained once, for all
policies, before any role starts. It runs each policy's ``sft`` (its examples, batch size, steps and learning rate) on
the one model, their steps interleaved (``train/sft.py``: ``interleaved_sft``), and saves a model directory. Every role
then loads that directory as ``model.pretrained`` with ``sft.steps: 0`` (:func:`on_base`): the trainers adapt it, the
nodes build it, and nothing of the base travels on the plane.

``astraflow up`` does it into the run directory (``base/``) before the roles start; a resumed run whose warm start is
unchanged (:func:`base_key`) reuses it. By hand: ``astraflow warm-start RECIPE --out DIR``, then every role on the
recipe with ``--set model.pretrained=DIR --set sft.steps=0`` (a node on another machine needs a copy of ``DIR``, as
of any pretrained model).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from astraflow.config import Recipe, parse_recipe

log = logging.getLogger(__name__)

RECORD = "warm_start.json"  # beside the saved model: the key it was trained for, and how


def needs_base_warm_start(recipe: Recipe) -> bool:
    """Whether ``recipe`` shares a base that some policy's warm start would train."""
    return recipe.rollout.shared_base and any(p.sft.steps for p in recipe.policies.values())


def _file_digest(path: str | None) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None


def base_key(recipe: Recipe) -> str:
    """What the warm-started base depends on: the model, the data, each policy's warm start (with its demonstrations'
    contents; threads aside) and the seed."""
    primary = recipe.policies[recipe.primary]
    what = {"model": primary.model.model_dump(mode="json"), "data": recipe.data.model_dump(mode="json"),
            "seed": primary.trainer.seed,
            "sft": {name: {**p.sft.model_dump(mode="json", exclude={"threads"}), "demonstrations": _file_digest(p.sft.demonstrations)}
                    for name, p in recipe.policies.items() if p.sft.steps}}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def held_key(out: Path) -> str | None:
    """The key of the base warm-started into ``out``, or None when it holds none (whole)."""
    return json.loads((out / RECORD).read_text()).get("key") if (out / RECORD).exists() else None


def warm_base(recipe: Recipe, out: Path, threads: int, progress: Callable[[int, int], None] | None = None) -> bool:
    """Train the shared base of ``recipe`` into ``out`` (a model directory), unless ``out`` holds it already; returns
    whether it trained. ``progress`` is told (steps done, steps in all) after each step."""
    import torch
    from transformers.utils import logging as hf_logging

    from astraflow.models import build_model, load_tokenizer
    from astraflow.tasks import load_split
    from astraflow.train.sft import interleaved_sft

    key = base_key(recipe)
    if held_key(out) == key:
        return False
    if out.exists() and not (out / RECORD).exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} holds files and no warm-started base ({RECORD}): give a new or empty directory")
    primary = recipe.policies[recipe.primary]
    cfgs = {name: p.sft for name, p in recipe.policies.items() if p.sft.steps}
    total = sum(cfg.steps for cfg in cfgs.values())
    torch.manual_seed(primary.trainer.seed)
    tokenizer = load_tokenizer(primary.model.tokenizer)
    model: Any = build_model(primary.model, tokenizer)
    train, _ = load_split(recipe.data)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    loss = interleaved_sft(model, tokenizer, train, cfgs, primary.trainer.seed,
                           None if progress is None else (lambda done: progress(done, total)))
    partial = out.with_name(out.name + ".partial")  # a warm start killed midway leaves no base that looks whole
    shutil.rmtree(partial, ignore_errors=True)
    hf_logging.disable_progress_bar()  # the launcher's own bar said how far it is
    model.save_pretrained(partial)
    record = {"key": key, "steps": {name: cfg.steps for name, cfg in cfgs.items()}, "last_loss": round(loss, 4),
              "seconds": round(time.perf_counter() - t0, 1), "threads": threads}
    (partial / RECORD).write_text(json.dumps(record, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    log.info("shared base warm-started: %s", record)
    return True


def on_base(recipe: Recipe, base: Path) -> Recipe:
    """``recipe`` with every policy on the warm-started base in ``base``: ``model.pretrained`` set, no warm start of
    its own."""
    data = recipe.model_dump(mode="json", by_alias=True)
    for section in [data, *data["policies"].values()]:
        section["model"]["pretrained"] = str(base.resolve())
        section["sft"]["steps"] = 0
    return parse_recipe(data, f"{recipe.name} on the base in {base}")
