"""The trainer role (``astraflow worker trainer``): the model, an optional SFT warm start, the backend and its ranks; then
rank 0 runs the loop of ``train/loop.py`` on the plane while the other ranks follow it (``train/distributed.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch

from astraflow.config import Recipe
from astraflow.models import build_model, load_tokenizer
from astraflow.role import Role
from astraflow.streams.plane import NatsOptions
from astraflow.tasks import load_split
from astraflow.train.backend import build_backend
from astraflow.train.checkpoint import Checkpointer
from astraflow.train.distributed import Collective, barrier_for
from astraflow.train.loop import TrainerLoop
from astraflow.train.sft import sft
from astraflow.train.threads import pin, threads_for

log = logging.getLogger(__name__)


def embedding_rows(model: torch.nn.Module) -> int:
    """Rows of the model's input embedding: token ids a batch may hold are below this."""
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    return int(embeddings.num_embeddings)


async def serve(recipe: Recipe, nats: NatsOptions, run: str, worker_id: str = "trainer", policy: str | None = None,
                checkpoint_dir: str | Path | None = None, metrics_port: int | None = None, fresh_lineage: bool = False) -> None:
    policy = policy or recipe.primary
    if policy not in recipe.policies:
        raise ValueError(f"policy {policy!r} is not in the recipe ({list(recipe.policies)})")
    pcfg = recipe.policies[policy]
    cfg = pcfg.trainer
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(pcfg.model.tokenizer)
    model = build_model(pcfg.model, tokenizer)
    resuming = not fresh_lineage and checkpoint_dir is not None and any(Path(checkpoint_dir).glob("v*/meta.json"))
    if pcfg.sft.steps and not resuming:
        train, _ = load_split(recipe.data)
        torch.set_num_threads(threads_for(pcfg.sft.threads))
        log.info("SFT warm start begins: %d steps on %d threads", pcfg.sft.steps, torch.get_num_threads())
        t0 = time.perf_counter()
        loss = await asyncio.to_thread(sft, model, tokenizer, train, pcfg.sft, cfg.seed)
        log.info("SFT warm start: %d steps in %.0f s on %d threads, last loss %.3f", pcfg.sft.steps, time.perf_counter() - t0,
                 torch.get_num_threads(), loss)
    torch.set_num_threads(threads_for(cfg.threads))
    if isinstance(cfg.cores, list) and pin(cfg.cores):  # after the warm start, which takes every core
        log.info("training on %d torch threads, on CPUs %s", torch.get_num_threads(), cfg.cores)
    else:
        log.info("training on %d torch threads", torch.get_num_threads())
    backend = build_backend(cfg.backend, model, tokenizer, cfg, temperature=recipe.rollout.temperature)
    ckpt = None
    if checkpoint_dir is not None:
        ckpt = Checkpointer(Path(checkpoint_dir), keep=cfg.checkpoint_keep, rank=backend.rank, barrier=barrier_for(backend))
    run_op = Collective(backend, ckpt, peer_timeout=cfg.peer_timeout)
    if backend.rank != 0:  # data-parallel ranks follow rank 0, which alone talks to the plane
        await asyncio.to_thread(run_op.follow)
        return
    try:
        async with Role("trainer", nats, run, worker_id, recipe.plane.server_gone_timeout, metrics_port, policy=policy) as role:
            await role.plane.ensure_topology(recipe.topology(), create=False)
            await TrainerLoop(recipe, policy, role, run_op, ckpt, embedding_rows(model), fresh_lineage).run()
    finally:
        run_op.stop()
