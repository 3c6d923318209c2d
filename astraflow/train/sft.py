"""Supervised warm start on reference answers, before version 0 (prompt tokens masked)."""

from __future__ import annotations

import random
from typing import Any

import torch

from astraflow.config import SFTConfig
from astraflow.models import encode_prompt
from astraflow.tasks import Problem


def sft(model: torch.nn.Module, tokenizer: Any, problems: list[Problem], cfg: SFTConfig, seed: int = 0) -> float:
    """Train ``model`` in place on ``cfg.steps`` batches of prompt + answer; returns the last loss.

    Runs on the plain module, before any backend wraps it, with its own AdamW (the RL
    optimizer starts fresh at version 0).
    """
    rng = random.Random(seed)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    eos, loss = tokenizer.eos_token_id, torch.tensor(0.0)
    model.train()
    for _ in range(cfg.steps):
        chosen = [rng.choice(problems) for _ in range(cfg.batch_size)]
        prompts = [encode_prompt(tokenizer, p.prompt) for p in chosen]
        seqs = [pr + encode_prompt(tokenizer, p.meta["answer"]) + [eos] for pr, p in zip(prompts, chosen)]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs], device=device)
        labels = ids.clone()
        for i, (pr, s) in enumerate(zip(prompts, seqs)):
            labels[i, : len(pr)] = -100
            labels[i, len(s) :] = -100
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.item())
