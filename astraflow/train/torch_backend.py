"""``torch`` trainer backend: single process, CPU or GPU, PPO-clip against the behaviour logprobs."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from astraflow.config import SFTConfig, TrainerConfig
from astraflow.models import encode_prompt
from astraflow.streams.messages import Batch
from astraflow.tasks import Problem
from astraflow.train.batching import to_tensors
from astraflow.train.losses import gather_logprobs, ppo_clip_loss, token_entropy


class TorchBackend:
    def __init__(self, model: torch.nn.Module, tokenizer: Any, cfg: TrainerConfig, temperature: float = 1.0, device: str = "cpu") -> None:
        self.model = model.to(device)
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.temperature = temperature
        self.device = device
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def step(self, batch: Batch) -> dict[str, float]:
        t0 = time.perf_counter()
        self.model.train()
        x = to_tensors(batch, self.tokenizer.pad_token_id)
        logits = self.model(input_ids=x.input_ids.to(self.device), attention_mask=x.attention_mask.to(self.device)).logits  # (B, L, V)
        rows = torch.arange(logits.shape[0], device=self.device)[:, None]
        comp_logits = logits[rows, x.logit_index.to(self.device)] / self.temperature  # (B, T, V)
        logprobs = gather_logprobs(comp_logits, x.targets.to(self.device))  # (B, T)
        out = ppo_clip_loss(logprobs, x.behave_logprobs.to(self.device), x.advantages.to(self.device), x.mask.to(self.device),
                            clip_low=self.cfg.clip_low, clip_high=self.cfg.clip_high)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        with torch.no_grad():
            m = x.mask.to(self.device)
            entropy = (token_entropy(comp_logits.detach()) * m).sum() / m.sum().clamp(min=1)
        dt = time.perf_counter() - t0
        return {"loss": float(out.loss.item()), "grad_norm": float(grad_norm), "entropy": float(entropy),
                "reward_mean": float(x.rewards.mean()), "tokens": float(x.n_tokens), "tokens_per_s": x.n_tokens / dt,
                "step_s": dt, **out.metrics}

    def sft(self, problems: list[Problem], cfg: SFTConfig, seed: int = 0) -> float:
        """Supervised warm start on reference answers (prompt tokens masked). Returns the last loss."""
        rng = random.Random(seed)
        opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        eos, loss = self.tokenizer.eos_token_id, torch.tensor(0.0)
        self.model.train()
        for _ in range(cfg.steps):
            chosen = [rng.choice(problems) for _ in range(cfg.batch_size)]
            prompts = [encode_prompt(self.tokenizer, p.prompt) for p in chosen]
            seqs = [pr + encode_prompt(self.tokenizer, p.meta["answer"]) + [eos] for pr, p in zip(prompts, chosen)]
            width = max(map(len, seqs))
            ids = torch.tensor([s + [self.tokenizer.pad_token_id] * (width - len(s)) for s in seqs], device=self.device)
            labels = ids.clone()
            for i, (pr, s) in enumerate(zip(prompts, seqs)):
                labels[i, : len(pr)] = -100
                labels[i, len(s) :] = -100
            loss = self.model(input_ids=ids, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return float(loss.item())
