"""The ``hf`` engine's own decoding loop (``engines/sampler.py``): it decodes as ``generate`` does, and it samples the
distribution whose logprob it reports."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from astraflow.config import ModelConfig
from astraflow.models import build_model, decode_text, load_tokenizer
from astraflow.rollout.engines import hf
from astraflow.rollout.engines.base import GenerationRequest, SamplingParams
from astraflow.rollout.engines.hf import HFEngine, stop_at
from astraflow.rollout.engines.sampler import runs_itself, sample

TOK = load_tokenizer("byt5")
DENSE = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=3)
MODELS = {
    "dense": DENSE,
    "window": DENSE.model_copy(update={"attention_window": 3}),
    "moe": DENSE.model_copy(update={"arch": "qwen3_moe", "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 16}),
}


def completions(engine: HFEngine, requests: list[GenerationRequest], loop: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    monkeypatch.setattr(hf, "runs_itself", runs_itself if loop else (lambda model: False))
    assert hf.runs_itself(engine.model) is loop
    return engine.generate(requests)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("prompts", [[[10, 11, 12, 13], [20, 21], [10, 11, 12, 13], [30, 31, 32]], [[40, 41, 42], [50, 51, 52]]],
                         ids=["padded", "unpadded"])
def test_the_loop_decodes_greedy_as_generate_does(monkeypatch, model: str, prompts: list[list[int]]):
    """Greedy: the same tokens, logprobs, finish reasons and versions as transformers' ``generate`` (plain, sliding-window
    and MoE models; rows left-padded or not, groups sharing their prompt's prefill); with a stop string, each row cut
    where the stop string completes in its text."""
    engine = HFEngine(build_model(MODELS[model], TOK), TOK)
    engine.set_version(3)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    requests = [GenerationRequest(p, greedy) for p in prompts]
    ours, theirs = completions(engine, requests, True, monkeypatch), completions(engine, requests, False, monkeypatch)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a.versions == b.versions == [3] * len(a.token_ids)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    text = decode_text(TOK, ours[0].token_ids)
    stop = text[len(text) // 2: len(text) // 2 + 2]  # two characters from the middle of the first row's text
    assert stop, "the first row decoded to no text"
    cut = completions(engine, [GenerationRequest(p, SamplingParams(max_new_tokens=12, temperature=0.0, stop=(stop,))) for p in prompts],
                      True, monkeypatch)
    for whole, c in zip(ours, cut, strict=True):  # generate would also stop on a stop string the prompt's end begins
        k = stop_at(TOK, whole.token_ids, (stop,))
        assert (c.token_ids, c.finish_reason) == ((whole.token_ids[:k], "stop") if k else (whole.token_ids, whole.finish_reason))
        assert c.logprobs == whole.logprobs[:len(c.token_ids)]
    assert cut[0].finish_reason == "stop"
    forward, calls = engine.model.forward, []
    monkeypatch.setattr(engine.model, "forward", functools.wraps(forward)(lambda *a, **kw: calls.append(1) or forward(*a, **kw)))
    [alone] = engine.generate([GenerationRequest(prompts[0], SamplingParams(max_new_tokens=12, temperature=0.0, stop=(stop,)))])
    assert alone.token_ids == cut[0].token_ids and len(calls) == len(alone.token_ids)  # no step decoded past the stop


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.8), (1.5, 0.3)])
def test_sampled_tokens_follow_the_tempered_softmax_within_the_nucleus(temperature: float, top_p: float):
    """Over many rows of the same logits, each token's frequency is its probability under softmax(z / T) cut to the
    top-p nucleus and renormalised; a token outside the nucleus is never drawn; each reported logprob is
    log_softmax(z / T) of the drawn token."""
    z = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=temperature, top_p=top_p)
    torch.manual_seed(0)
    rows = 40_000
    tokens, logprobs = sample(z.expand(rows, -1), params)
    logp = torch.log_softmax(z / temperature, -1)
    p = logp.exp()
    ranked = p.sort(descending=True)
    kept = torch.zeros_like(p, dtype=torch.bool)
    kept[ranked.indices[(ranked.values.cumsum(0) - ranked.values) < top_p]] = True
    expected = torch.where(kept, p, 0.0) / p[kept].sum()
    seen = torch.bincount(tokens, minlength=len(z)).double() / rows
    assert not seen[~kept].any(), "a token outside the nucleus was drawn"
    for q, f in zip(expected.tolist(), seen.tolist(), strict=True):
        assert abs(f - q) <= 5 * math.sqrt(q * (1 - q) / rows) + 1e-9, (expected, seen)
    assert torch.allclose(logprobs, logp[tokens])


def test_sampling_is_reproducible_under_a_seed_and_greedy_takes_the_argmax():
    z = torch.randn(64, len(TOK))
    params = SamplingParams(temperature=1.0)
    torch.manual_seed(5)
    a = sample(z, params)[0]
    torch.manual_seed(5)
    assert torch.equal(a, sample(z, params)[0])
    assert not torch.equal(a, sample(z, params)[0])
    tokens, logprobs = sample(z, SamplingParams(temperature=0.0))
    assert torch.equal(tokens, z.argmax(-1)) and torch.allclose(logprobs, torch.log_softmax(z, -1).max(-1).values)
    certain = torch.full((4, 8), -1e4)
    certain[:, 5] = 0.0  # all the mass on one token: drawn whatever the uniform
    assert sample(certain, params)[0].tolist() == [5] * 4
    with pytest.raises(ValueError, match="not finite"):
        sample(torch.full((2, 8), float("nan")), params)
