"""Shared by the weight-plane tests: a tiny real Qwen2, real AdamW steps, a RaaS node's sync."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from astraflow.rollout.engines.hf import HFEngine
from astraflow.streams.plane import Plane
from astraflow.weights.delta import state_digest, to_bf16_state
from astraflow.weights.sync import WeightSync

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, vocab_size=384)
WIDE = dict(hidden_size=64, vocab_size=65536)  # 8.5 M params: payloads of several 2 MiB chunks


def tiny_model(seed: int, **config: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**(TINY | config)))


class Trainer:
    """Real AdamW steps on random tokens; ``only`` restricts the trained parameters (by name)."""

    def __init__(self, seed: int = 0, lr: float = 1e-4, only: str | None = None, **config: int) -> None:
        self.model = tiny_model(seed, **config)
        params = [p for n, p in self.model.named_parameters() if only is None or n == only]
        self.opt = torch.optim.AdamW(params, lr=lr)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> dict[str, torch.Tensor]:
        x = torch.randint(0, self.model.config.vocab_size, (2, 16), generator=self.gen)
        self.model(input_ids=x, labels=x).loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return self.model.state_dict()

    @property
    def digest(self) -> str:
        return state_digest(to_bf16_state(self.model.state_dict()))


def node(plane: Plane, config: dict[str, int] | None = None, **kw) -> WeightSync:
    return WeightSync(plane, "solver", HFEngine(tiny_model(123, **(config or {})), tokenizer=None), **kw)


def engine_digest(sync: WeightSync) -> str:
    return state_digest(to_bf16_state(sync.engine.state_view()))
