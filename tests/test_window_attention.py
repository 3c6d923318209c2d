"""Sliding-window attention (``model.attention_window``): exact, linear in the row length, and the same model
for training rows (right padding), prompts (left padding) and decoding over a KV cache."""

from __future__ import annotations

import pytest
import torch

from astraflow.config import ModelConfig, RecipeError, parse_recipe
from astraflow.models import build_model, load_tokenizer
from astraflow.window_attention import blocked, dense

TOK = load_tokenizer("byt5")
SHAPE = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=64)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, W: int, real: torch.Tensor | None) -> torch.Tensor:
    """Attention with an explicit (L, L) band mask, the quadratic way."""
    L = q.shape[2]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    allowed = (j <= i) & (i - j < W)
    if real is not None:
        allowed = allowed[None, None] & real[:, None, None, :]
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("L,W", [(37, 8), (64, 16), (5, 16), (1, 4)])
def test_blocks_and_decoding_compute_exactly_the_band(L: int, W: int):
    g = torch.Generator().manual_seed(L * W)
    q, k, v = (torch.randn(2, 3, L, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    real = torch.ones(2, L, dtype=torch.bool)
    real[1, : L // 3] = False  # left padding
    rows = real[:, None, :, None]  # a padding query sees no real key: what it gets is never read
    want = reference(q, k, v, W, real) * rows
    got = blocked(q, k, v, W, real, 8**-0.5) * rows
    assert torch.allclose(got, want, atol=1e-10)
    last = dense(q[:, :, -3:], k, v, W, real, 8**-0.5) * rows[:, :, -3:]  # the last queries over a cache
    assert torch.allclose(last, want[:, :, -3:], atol=1e-10)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v)), strict=True))


def models(window: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    full = build_model(ModelConfig(**SHAPE), TOK)
    windowed = build_model(ModelConfig(**SHAPE, attention_window=window), TOK)
    windowed.load_state_dict(full.state_dict())
    return full, windowed


def test_a_window_as_long_as_the_row_is_full_causal_attention_for_training_and_generation():
    full, windowed = models(window=64)
    ids = torch.randint(3, 259, (3, 40), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    att[1, 30:] = 0  # right padding (training rows)
    att[2, :6] = 0  # left padding (prompts)
    real = att.bool()
    with torch.no_grad():
        want, got = full(input_ids=ids, attention_mask=att).logits[real], windowed(input_ids=ids, attention_mask=att).logits[real]
        assert torch.allclose(want, got, atol=1e-5)
        prompts, masks = ids[:, :12], att[:, :12].clone()
        masks[1] = 1
        kw = dict(attention_mask=masks, max_new_tokens=10, do_sample=False, pad_token_id=TOK.pad_token_id)
        assert torch.equal(full.generate(input_ids=prompts, **kw), windowed.generate(input_ids=prompts, **kw))


def test_a_token_sees_no_further_back_than_the_window():
    _, windowed = models(window=8)  # two layers: token i sees inputs back to i - 2 * (8 - 1)
    ids = torch.randint(3, 259, (1, 60), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, 0] = 3 if ids[0, 0] != 3 else 4
    with torch.no_grad():
        a, b = windowed(input_ids=ids).logits, windowed(input_ids=changed).logits
    assert not torch.allclose(a[0, 14], b[0, 14]) and torch.equal(a[0, 15:], b[0, 15:])


def test_the_window_is_for_models_built_from_the_config():
    with pytest.raises(RecipeError, match="attention_window applies to models built from the config"):
        parse_recipe({"name": "t", "model": {"pretrained": "Qwen/Qwen3-0.6B", "attention_window": 64}})
    with pytest.raises(RecipeError, match="attention_window"):
        parse_recipe({"name": "t", "model": {"attention_window": 0}})
