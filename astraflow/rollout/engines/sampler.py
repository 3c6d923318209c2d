"""The ``hf`` engine's decoding loop: a batch's forward passes over a KV cache, one token a row a step.

It does what the engine used transformers' ``generate`` for, and no more, so a step costs the model's forward and a
few tensor operations. On a 2-core CPU a batch of the in-process recipe takes 0.85–0.92 of ``generate``'s CPU, and a
draw for 64 rows 0.27 ms against ``torch.multinomial``'s 0.93 (``benchmarks/bench_sampler.py``). For the last
position's logits z of a row:

    q = softmax(z / T), cut to the top-p nucleus: the tokens whose more likely tokens hold less than p of the mass
    token = the first i with Q_i > u · Q_V, Q the cumulative sum of q, u ~ U[0, 1)  (inverse CDF: one uniform a row)
    behaviour logprob = log_softmax(z / T)[token]          (what the trainer recomputes; top-p aside)

Temperature 0 takes argmax z, scored by log_softmax(z). A row ends at EOS or at a pad token (the engine's ``_Row``
cuts there), or when its completion's text holds a stop string (not one its prompt's end begins, as ``generate``
would); an ended row gets pad tokens while the others go on. A weight load waiting (``interrupt``) stops the run
after the step in flight. Nothing else of a pretrained model's ``generation_config`` (a repetition penalty, say)
shapes the draw, so the logprob reported is that of the distribution sampled.

A model the loop cannot run as ``generate`` would (:func:`runs_itself`) is generated with ``generate`` itself
(:func:`generate_run`), same arguments and result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from astraflow.models import forward_takes
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.shared_prefill import cache_argument


@dataclass
class Run:
    """One decoding run of a batch: each row's new tokens (pad after the row ended) and their behaviour logprobs."""

    tokens: torch.Tensor  # (B, T) long, on the CPU
    logprobs: torch.Tensor  # (B, T) float32
    interrupted: bool  # a load was waiting: the run stopped after the step in flight


Stopped = Callable[[int, list[int]], bool]  # (row, its tokens this run) -> its text now holds a stop string


def sample(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, behaviour logprobs), each (B,), for the rows' last-position ``logits`` (B, V) under ``params``."""
    z = logits.float() / (params.temperature or 1.0)
    logp = torch.log_softmax(z, dim=-1)  # (B, V)
    if params.temperature == 0:
        tokens = z.argmax(dim=-1)
    else:
        q, order = logp.exp(), None
        if params.top_p < 1.0:
            q, order = q.sort(dim=-1, descending=True)
            q = q.masked_fill(q.cumsum(-1) - q >= params.top_p, 0.0)  # the mass before a token already reaches p
        cdf = q.cumsum(dim=-1)
        total = cdf[:, -1:]
        if not bool(torch.isfinite(total).all()):  # a NaN would draw an id past the vocabulary, or any id
            raise ValueError("the model's logits are not finite: nothing can be sampled from them")
        u = torch.minimum(torch.rand(total.shape, device=z.device) * total, total.nextafter(torch.zeros_like(total)))
        tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # u < Q_V: an index whose q > 0
        if order is not None:
            tokens = order.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def runs_itself(model: Any) -> bool:
    """Whether the loop can decode ``model`` as ``generate`` would: a decoder-only model for which ``generate`` makes
    transformers' dynamic cache (no ``cache_implementation`` but "dynamic") and prepares each step's inputs the
    default way (a model that overrides ``prepare_inputs_for_generation`` feeds its forward more than ids, mask,
    positions and cache)."""
    from transformers import GenerationMixin

    asked = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # peft: the model it adapts
    supports = getattr(base, "_supports_default_dynamic_cache", None)
    default_inputs = getattr(type(base), "prepare_inputs_for_generation", None) is GenerationMixin.prepare_inputs_for_generation
    return (asked in (None, "dynamic") and callable(supports) and bool(supports()) and default_inputs
            and not base.config.is_encoder_decoder)


@torch.no_grad()
def decode_run(model: Any, ids: torch.Tensor, att: torch.Tensor, params: SamplingParams, steps: int, *, pad: int, eos: int,
               cached: dict[str, Any], forward: dict[str, Any], stopped: Stopped | None,
               interrupt: Callable[[], bool] | None) -> Run:
    """Decode up to ``steps`` tokens for each row of the left-padded batch ``ids``, ``att`` (B, W).

    ``cached``: a cache holding every row's first W − 1 positions (``shared_prefill``), or empty; ``forward``: extra
    arguments of every forward (peft's ``adapter_names``). ``stopped`` is asked after each step for the rows still
    decoding when the requests have stop strings."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids, att = ids.to(device), att.to(device)
    name = cache_argument(model)
    positions = (att.cumsum(-1) - 1).masked_fill(att == 0, 1)  # as generate numbers left-padded rows
    if cached:
        cache, inputs, positions = cached[name], ids[:, -1:], positions[:, -1:]
    else:
        cache, inputs = DynamicCache(config=model.config.get_text_config(decoder=True)), ids
    keep = {"logits_to_keep": 1} if forward_takes(model, "logits_to_keep") else {}
    padded = not bool(att.all())  # else no mask: the model's causal attention, without building a mask a step
    decoding = torch.ones(ids.shape[0], dtype=torch.bool, device=device)
    tokens: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    texts: list[list[int]] = [[] for _ in range(ids.shape[0])] if stopped else []
    interrupted = False
    for step in range(steps):
        if step:
            att = torch.cat([att, att.new_ones(att.shape[0], 1)], dim=1) if padded else att
            positions = positions[:, -1:] + 1
        out = model(input_ids=inputs, attention_mask=att if padded else None, position_ids=positions, use_cache=True, **{name: cache},
                    **keep, **forward)
        token, logp = sample(out.logits[:, -1, :], params)
        token = token.masked_fill(~decoding, pad)
        tokens.append(token)
        logprobs.append(logp)
        decoding &= (token != eos) & (token != pad)
        if stopped:
            for i, t in enumerate(token.tolist()):
                texts[i].append(t)
                if decoding[i] and stopped(i, texts[i]):
                    decoding[i] = False
        if not bool(decoding.any()):
            break
        if interrupt is not None and interrupt():
            interrupted = True
            break
        inputs = token[:, None]
    return Run(torch.stack(tokens, dim=1).cpu(), torch.stack(logprobs, dim=1).float().cpu(), interrupted)


@torch.no_grad()
def generate_run(model: Any, ids: torch.Tensor, att: torch.Tensor, params: SamplingParams, steps: int, *, tokenizer: Any,
                 cached: dict[str, Any], forward: dict[str, Any], interrupt: Callable[[], bool] | None) -> Run:
    """:func:`decode_run` through ``generate``, for a model the loop does not run itself (:func:`runs_itself`)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    fired = [False]

    class LoadWaiting(StoppingCriteria):  # stops after the step during which a load started waiting
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
            fired[0] = interrupt is not None and interrupt()
            return torch.full((input_ids.shape[0],), fired[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]

    device = next(model.parameters()).device
    greedy = params.temperature == 0
    out = model.generate(
        input_ids=ids.to(device), attention_mask=att.to(device), max_new_tokens=steps, do_sample=not greedy,
        temperature=None if greedy else params.temperature, top_p=None if greedy else params.top_p, top_k=None if greedy else 0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, stop_strings=list(params.stop) or None,
        tokenizer=tokenizer if params.stop else None, stopping_criteria=StoppingCriteriaList([LoadWaiting()]) if interrupt else None,
        output_logits=True, return_dict_in_generate=True, **forward, **cached,
    )
    new = out.sequences[:, ids.shape[1]:].cpu()  # (B, T)
    logits = torch.stack(out.logits, dim=1).float().cpu() / (params.temperature or 1.0)  # (B, T, V)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return Run(new, logp, fired[0])
