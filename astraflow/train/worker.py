"""The trainer role (``astraflow worker trainer``): the model, an optional SFT warm start, the backend and its ranks; then
rank 0 runs the loop of ``train/loop.py`` on the plane while the other ranks follow it (``train/distributed.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from astraflow.config import Recipe
from astraflow.models import build_model, load_tokenizer
from astraflow.role import Role, TrainerOptions
from astraflow.streams.messages import HEARTBEAT_PERIOD_S, Heartbeat, TrainerStats
from astraflow.tasks import load_split
from astraflow.train.backend import build_backend
from astraflow.train.checkpoint import Checkpointer
from astraflow.train.distributed import Collective, barrier_for
from astraflow.train.loop import TrainerLoop
from astraflow.train.sft import sft
from astraflow.train.threads import background_executor, pin, spare_cores, threads_for
from astraflow.weights.delta import state_digest, to_bf16_state

log = logging.getLogger(__name__)


def embedding_rows(model: torch.nn.Module) -> int:
    """Rows of the model's input embedding: token ids a batch may hold are below this."""
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    return int(embeddings.num_embeddings)


async def warm_start(recipe: Recipe, policy: str, model: torch.nn.Module, tokenizer: Any, options: TrainerOptions) -> bool:
    """The SFT warm start before v0 (``train/sft.py``); whether the trainer goes on (False: it was told to stop meanwhile).
    Rank 0 says how far it is in heartbeats (``TrainerStats.warm_start_done``), which the launcher's live view shows."""
    pcfg = recipe.policies[policy]
    train, _ = load_split(recipe.data)
    torch.set_num_threads(threads_for(pcfg.sft.threads))
    log.info("SFT warm start begins: %d steps on %d threads", pcfg.sft.steps, torch.get_num_threads())
    t0, done, go_on = time.perf_counter(), 0, True

    def progress(steps: int) -> None:  # from the SFT thread; read by the heartbeat
        nonlocal done
        done = steps

    if os.environ.get("RANK", "0") == "0":  # the rank that will be on the plane (a data-parallel group's other ranks are silent)
        async with Role("trainer", options, recipe.plane.server_gone_timeout, metrics=False) as role:
            async def beat() -> None:
                stats = TrainerStats(warm_start_steps=pcfg.sft.steps, warm_start_done=done)
                await role.plane.beat(Heartbeat(worker_id=options.worker_id, policy=policy, stats=stats, state="starting"))

            role.every(HEARTBEAT_PERIOD_S, beat)
            loss = await asyncio.to_thread(sft, model, tokenizer, train, pcfg.sft, pcfg.trainer.seed, progress)
            go_on = not role.stop.is_set()
    else:
        loss = await asyncio.to_thread(sft, model, tokenizer, train, pcfg.sft, pcfg.trainer.seed)
    log.info("SFT warm start: %d steps in %.0f s on %d threads, last loss %.3f", pcfg.sft.steps, time.perf_counter() - t0,
             torch.get_num_threads(), loss)
    return go_on


async def serve(recipe: Recipe, options: TrainerOptions) -> None:
    policy, checkpoint_dir, fresh_lineage = options.policy or recipe.primary, options.checkpoint_dir, options.fresh_lineage
    if policy not in recipe.policies:
        raise ValueError(f"policy {policy!r} is not in the recipe ({list(recipe.policies)})")
    pcfg = recipe.policies[policy]
    if recipe.rollout.shared_base and pcfg.sft.steps:
        raise ValueError(f"policy {policy!r}: sft.steps under rollout.shared_base: the warm start is the shared base's, trained "
                         "once for every policy (astraflow up does it; by hand: astraflow warm-start RECIPE --out DIR, then "
                         "every role with --set model.pretrained=DIR --set sft.steps=0)")
    cfg = pcfg.trainer
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(pcfg.model.tokenizer)
    model: torch.nn.Module = build_model(pcfg.model, tokenizer)
    built = None  # LoRA adapters over the model the recipe builds: every node holds their base already
    if cfg.lora is not None and cfg.lora.announce == "adapter":
        built = await asyncio.to_thread(lambda: state_digest(to_bf16_state(model.state_dict())))
    resuming = not fresh_lineage and checkpoint_dir is not None and any(Path(checkpoint_dir).glob("v*/meta.json"))
    if pcfg.sft.steps and not resuming and not await warm_start(recipe, policy, model, tokenizer, options):
        return  # told to stop during the warm start
    torch.set_num_threads(threads_for(cfg.threads))
    spare = spare_cores(cfg.cores) if isinstance(cfg.cores, list) else []  # what it may run on but does not train on
    if isinstance(cfg.cores, list) and pin(cfg.cores):  # after the warm start, which takes every core
        log.info("training on %d torch threads, on CPUs %s; checkpoints written on %s", torch.get_num_threads(), cfg.cores,
                 spare or cfg.cores)
    else:
        spare = []
        log.info("training on %d torch threads", torch.get_num_threads())
    writer = background_executor(spare, "checkpoint-writer")
    backend = build_backend(cfg.backend, model, tokenizer, cfg, temperature=recipe.rollout.temperature)
    ckpt = None
    if checkpoint_dir is not None:
        ckpt = Checkpointer(Path(checkpoint_dir), keep=cfg.checkpoint_keep, rank=backend.rank, barrier=barrier_for(backend))
    run_op = Collective(backend, ckpt, peer_timeout=cfg.peer_timeout)
    if backend.rank != 0:  # data-parallel ranks follow rank 0, which alone talks to the plane
        await asyncio.to_thread(run_op.follow)
        return
    try:
        async with Role("trainer", options, recipe.plane.server_gone_timeout, policy=policy) as role:
            await role.plane.ensure_topology(recipe.topology(), create=False)
            await TrainerLoop(recipe, policy, role, run_op, ckpt, embedding_rows(model), fresh_lineage, built, writer).run()
    finally:
        run_op.stop()
        writer.shutdown(wait=False)  # the loop awaited every write it started
