"""Supervised warm start before version 0: on reference answers, or on multi-turn demonstrations.

Without ``sft.demonstrations`` an example is prompt + reference answer + EOS, the answer trained on.
With it, an example is a recorded episode (``astraflow.demonstrations``): only the text the model
wrote is trained on; the prompt and what the workflow inserted (tool output, observations) are
masked out, as ``loss_mask`` masks them in RL. Only episodes of training prompts are used.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from astraflow.config import SFTConfig
from astraflow.demonstrations import demonstration_tokens, read_demonstrations
from astraflow.models import encode_prompt
from astraflow.tasks import Problem

Example = tuple[list[int], list[bool]]  # token ids, trained-on flags


def answer_examples(tokenizer: Any, problems: list[Problem]) -> list[Example]:
    out = []
    for p in problems:
        prompt, answer = encode_prompt(tokenizer, p.prompt), encode_prompt(tokenizer, p.meta["answer"]) + [tokenizer.eos_token_id]
        out.append((prompt + answer, [False] * len(prompt) + [True] * len(answer)))
    return out


def demonstration_examples(tokenizer: Any, problems: list[Problem], path: str, max_len: int) -> list[Example]:
    """The episodes of ``path`` that play a training problem, tokenised; an episode longer than the model fails."""
    train_ids = {p.prompt_id for p in problems}
    demos = [d for d in read_demonstrations(path) if d.prompt_id in train_ids]
    if not demos:
        raise ValueError(f"sft.demonstrations {path}: no episode plays a training problem (held-out ones are never used)")
    out = []
    for d in demos:
        ids, trained = demonstration_tokens(d, tokenizer)
        if len(ids) > max_len:
            raise ValueError(f"sft.demonstrations {path}: the episode of {d.prompt_id} has {len(ids)} tokens, "
                             f"the model holds {max_len} (model.max_positions)")
        out.append((ids, trained))
    return out


def examples_for(tokenizer: Any, problems: list[Problem], cfg: SFTConfig, max_len: int) -> list[Example]:
    if cfg.demonstrations:
        return demonstration_examples(tokenizer, problems, cfg.demonstrations, max_len)
    return answer_examples(tokenizer, problems)


def interleave(steps: Mapping[str, int]) -> list[str]:
    """The order of several warm starts' steps on one model: the k-th of a warm start of n steps sits at (k + ½)/n of
    the way, so each is spread over the whole and none comes last (to be forgotten by the others' steps)."""
    slots = sorted(((k + 0.5) / n, order, name) for order, (name, n) in enumerate(steps.items()) for k in range(n))
    return [name for _, _, name in slots]


def sft(model: torch.nn.Module, tokenizer: Any, problems: list[Problem], cfg: SFTConfig, seed: int = 0,
        progress: Callable[[int], None] | None = None) -> float:
    """Train ``model`` in place on ``cfg.steps`` batches of examples; returns the last loss. ``progress`` is told the
    number of steps done after each.

    Runs on the plain module, before any backend wraps it, with its own AdamW (the RL
    optimizer starts fresh at version 0), its learning rate warmed up linearly over ``cfg.warmup_steps``.
    """
    return interleaved_sft(model, tokenizer, problems, {"": cfg}, seed, progress)


def interleaved_sft(model: torch.nn.Module, tokenizer: Any, problems: list[Problem], cfgs: Mapping[str, SFTConfig],
                    seed: int = 0, progress: Callable[[int], None] | None = None) -> float:
    """Several warm starts on one model (a shared base's: each policy's ``sft``), their steps interleaved
    (:func:`interleave`), each with its own examples, batch size and learning rate warmed up over its own steps; one
    AdamW. Returns the last loss; ``progress`` is told the number of steps done (of all) after each."""
    rng = random.Random(seed)
    max_len = int(cast(Any, model).config.max_position_embeddings)
    examples = {name: examples_for(tokenizer, problems, cfg, max_len) for name, cfg in cfgs.items()}
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=max(cfg.lr for cfg in cfgs.values()))
    done = dict.fromkeys(cfgs, 0)
    pad, loss = tokenizer.pad_token_id, torch.tensor(0.0)
    model.train()
    for step, name in enumerate(interleave({name: cfg.steps for name, cfg in cfgs.items()}), 1):
        cfg = cfgs[name]
        done[name] += 1
        for group in opt.param_groups:  # lr · min(1, k / warmup) at this warm start's k-th step
            group["lr"] = cfg.lr * (min(1.0, done[name] / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
        chosen = [rng.choice(examples[name]) for _ in range(cfg.batch_size)]
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s, _ in chosen], device=device)  # (B, T)
        trained = torch.tensor([t + [False] * (width - len(t)) for _, t in chosen], device=device)  # (B, T)
        labels = ids.masked_fill(~trained, -100)  # prompt, inserted text and padding carry no loss
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if progress is not None:
            progress(step)
    return float(loss.item())
