"""A batch's prompts read once per distinct context (the ``hf`` engine).

A group's samples share their prompt, so a batch of G groups of n samples holds G distinct contexts in G·n rows, and
``generate`` would run every row's prompt through the model. Instead the KV cache of each distinct context, all but
its last token, is computed once and repeated to the rows that hold it; ``generate`` then reads only each row's last
token before it samples. Each row gets the keys and values it would have computed itself (the same tokens, positions
and padding), so its tokens and logprobs are those of the plain path. For a batch W tokens wide, the token rows the
model reads before the first sample:

    plain:  rows · W          shared:  distinct · (W − 1) + rows

(64 rows of 8 prompts, W = 7: 448 against 112.) vLLM and SGLang share prefixes themselves (their prefix caches).
"""

from __future__ import annotations

from typing import Any

import torch

from astraflow.models import forward_takes


def shared_prefill(model: Any, ids: torch.Tensor, att: torch.Tensor) -> dict[str, Any]:
    """``generate``'s cache argument for the left-padded batch ``ids``, ``att`` (B, W): a cache holding every row's
    first W − 1 positions, each distinct one computed once. Empty (the plain path) when no two rows are alike, the
    batch is one token wide, the model carries peft adapters, or its attention is not one a plain cache holds (a
    sliding window of transformers' own)."""
    width = ids.shape[1]
    if width < 2 or hasattr(model, "peft_config") or not full_attention(model):  # peft: adapters follow rows
        return {}
    prefixes = torch.cat([ids[:, :-1], att[:, :-1]], dim=1)  # (B, 2(W − 1)): what the cache holds of each row
    distinct, rows = torch.unique(prefixes, dim=0, return_inverse=True)  # (D, 2(W − 1)), (B,)
    if distinct.shape[0] == ids.shape[0]:
        return {}
    from transformers import DynamicCache

    device = next(model.parameters()).device
    d_ids, d_att = distinct[:, : width - 1], distinct[:, width - 1 :]
    positions = (d_att.cumsum(-1) - 1).masked_fill(d_att == 0, 1)  # as generate numbers left-padded rows
    cache = DynamicCache()
    decoder = model.get_decoder()
    decoder(input_ids=d_ids.to(device), attention_mask=d_att.to(device), position_ids=positions.to(device), use_cache=True,
            **{cache_argument(decoder): cache})
    cache.batch_select_indices(rows.to(device))
    return {cache_argument(model): cache}


def full_attention(model: Any) -> bool:
    """Every layer attends to every earlier position, in the cache ``generate`` itself would use (a plain
    ``DynamicCache``: no ``cache_implementation`` asked for)."""
    config, asked = model.config, getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    return asked is None and all(t == "full_attention" for t in getattr(config, "layer_types", None) or ()) and not getattr(
        config, "use_sliding_window", False)


def cache_argument(module: Any) -> str:
    """The name ``module``'s forward (and its model's ``generate``) takes a KV cache under: ``cache`` from transformers
    5 on, ``past_key_values`` before."""
    return "cache" if forward_takes(module, "cache") else "past_key_values"
