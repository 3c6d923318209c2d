"""Sliding-window causal attention whose cost is linear in the row length (``model.attention_window``).

Token ``i`` attends to tokens ``j`` with ``i - W < j <= i`` (Mistral's sliding window; ``W`` =
``attention_window``), so a row of ``L`` tokens costs ``O(L · W)`` instead of ``O(L²)``: built
models (``models.build_model``) can then train and generate rows of hundreds of thousands of
tokens on a CPU (long multi-turn episodes in tests and benchmarks). Pretrained models keep their
own attention.

It is registered with transformers as the attention implementation ``astraflow_window``, with a
mask function that hands the attention the 2-D key padding mask (``(B, kv)``, True = a real token)
instead of a 4-D mask, or None when no token is padding.

* **Prefill / training** (as many queries as keys): queries are cut into blocks of ``W``; block
  ``b`` attends to key blocks ``b-1`` and ``b`` (``2W`` keys), masked to the band
  ``a < c <= W + a`` (query ``a`` of the block, key ``c`` of the two blocks: ``i - j = W + a - c``)
  and to real keys. Scores are ``(B, H, L/W, W, 2W)``: linear in ``L``.
* **Decoding** (fewer queries than keys, a KV cache): query ``q`` sits at position
  ``kv - Lq + q``; the scores are dense over the cache with the same band and padding mask.

Masked scores take the dtype's lowest value, not -inf, so a query with no real key (a left pad)
gets a finite average instead of NaN (as transformers' own attention does); softmax runs in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "astraflow_window"


def _band(W: int, device: torch.device) -> torch.Tensor:
    """(W, 2W) bool: query ``a`` of a block may see key ``c`` of the block before and its own (``a < c <= W + a``)."""
    a = torch.arange(W, device=device)[:, None]
    c = torch.arange(2 * W, device=device)[None, :]
    return (c > a) & (c <= W + a)


def _softmax_attend(scores: torch.Tensor, allowed: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    scores = scores if scores.dtype == torch.float64 else scores.float()  # softmax in fp32 at least
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


def blocked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, W: int, real: torch.Tensor | None, scale: float) -> torch.Tensor:
    """(B, H, L, D) queries over as many keys; ``real``: (B, L) bool key padding mask or None."""
    B, H, L, D = query.shape
    nb = -(-L // W)
    tail = nb * W - L
    q = F.pad(query, (0, 0, 0, tail)).view(B, H, nb, W, D)
    k = F.pad(key, (0, 0, W, tail)).view(B, H, nb + 1, W, D)  # one block of nothing in front: block b's keys are b-1, b
    v = F.pad(value, (0, 0, W, tail)).view(B, H, nb + 1, W, D)
    k2 = torch.cat([k[:, :, :-1], k[:, :, 1:]], dim=-2)  # (B, H, nb, 2W, D)
    v2 = torch.cat([v[:, :, :-1], v[:, :, 1:]], dim=-2)
    scores = torch.matmul(q, k2.transpose(-1, -2)) * scale  # (B, H, nb, W, 2W)
    keys = real if real is not None else torch.ones(B, L, dtype=torch.bool, device=query.device)
    keys = F.pad(keys, (W, tail), value=False).view(B, nb + 1, W)
    keys2 = torch.cat([keys[:, :-1], keys[:, 1:]], dim=-1)  # (B, nb, 2W): the keys that exist and are real
    allowed = _band(W, query.device)[None, None, None] & keys2[:, None, :, None, :]  # (B, 1, nb, W, 2W)
    return _softmax_attend(scores, allowed, v2).view(B, H, nb * W, D)[:, :, :L]


def dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, W: int, real: torch.Tensor | None, scale: float) -> torch.Tensor:
    """(B, H, Lq, D) queries, the last ``Lq`` positions of (B, H, Lk, D) keys (a decoding step over a KV cache)."""
    Lq, Lk = query.shape[2], key.shape[2]
    i = torch.arange(Lk - Lq, Lk, device=query.device)[:, None]
    j = torch.arange(Lk, device=query.device)[None, :]
    allowed = ((j <= i) & (i - j < W))[None, None]  # (1, 1, Lq, Lk)
    if real is not None:
        allowed = allowed & real[:, None, None, :]
    return _softmax_attend(torch.matmul(query, key.transpose(-1, -2)) * scale, allowed, value)


def window_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, Lq, D) in, (B, Lq, H, D) out, no weights."""
    W = int(module.config.attention_window)
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: every key head serves ``groups`` query heads
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    attend = blocked if query.shape[2] == key.shape[2] else dense
    return attend(query, key, value, W, attention_mask, scale).transpose(1, 2).contiguous(), None


def key_padding(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask-function contract, for ``window_attention``: the (B, kv) real-key mask, or None (no padding)."""
    if attention_mask is None:
        return None
    real = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    return None if bool(real.all()) else real


def known_to_transformers() -> str:
    """Make ``astraflow_window`` known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, window_attention)
    AttentionMaskInterface.register(NAME, key_padding)
    return NAME
