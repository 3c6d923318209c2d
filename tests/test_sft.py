"""The SFT warm start's learning-rate warmup: a step during warmup moves the weights by lr · step / warmup_steps."""

from __future__ import annotations

import pytest

from astraflow.config import SFTConfig, parse_recipe
from astraflow.models import build_model, load_tokenizer
from astraflow.tasks import Problem
from astraflow.train.sft import sft

TOK = load_tokenizer("byt5")
LR = 0.01


def largest_move(steps: int, warmup_steps: int) -> float:
    """The largest change of any weight over ``steps`` SFT steps. While the gradient keeps its sign, each AdamW step
    moves a weight by about its learning rate (m / √v ≈ ±1; weight decay adds lr · 0.01 · w), so this is about
    the sum of the steps' learning rates."""
    recipe = parse_recipe({"name": "s", "model": {"hidden_size": 32, "intermediate_size": 64}})
    model = build_model(recipe.policies["solver"].model, TOK)
    before = [p.detach().clone() for p in model.parameters()]
    sft(model, TOK, [Problem("p", "1+2=", {"answer": "3"})], SFTConfig(steps=steps, lr=LR, warmup_steps=warmup_steps, batch_size=2))
    return max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before, strict=True))


def test_without_warmup_every_step_takes_the_full_learning_rate():
    assert largest_move(1, 0) == pytest.approx(LR, rel=0.05)
    assert largest_move(2, 0) == pytest.approx(2 * LR, rel=0.05)


def test_warmup_rises_linearly_to_the_learning_rate():
    assert largest_move(2, 2) == pytest.approx(LR / 2 + LR, rel=0.05)
    assert largest_move(4, 4) == pytest.approx(LR * (1 + 2 + 3 + 4) / 4, rel=0.05)


def test_more_warmup_than_steps_fails_at_load_with_the_field_named():
    with pytest.raises(ValueError, match="sft.warmup_steps"):
        parse_recipe({"name": "s", "sft": {"steps": 10, "warmup_steps": 20}})
    assert parse_recipe({"name": "s", "sft": {"steps": 0, "warmup_steps": 20}})  # no warm start: nothing to warm up
