"""Tiny transformers models built from a config, and a tokenizer that needs no download.

Both rollout engines and trainers build the same architecture from the recipe's
:class:`~astraflow.config.ModelConfig`; weights then come from the plane (the trainer's
keyframe), so every role agrees bit for bit.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from astraflow.config import ModelConfig


@lru_cache(maxsize=4)
def load_tokenizer(name: str = "byt5") -> Any:
    """``byt5``: byte-level, file-free. Anything else is a local path or hub id (GPU recipes)."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    if name == "byt5":
        return ByT5Tokenizer()
    return AutoTokenizer.from_pretrained(name)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt token ids without the end-of-sequence id ByT5 appends to every encoding."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if ids and tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return list(ids)


def build_model(cfg: "ModelConfig", tokenizer: Any) -> "torch.nn.Module":
    """A causal LM from ``cfg``: ``arch: qwen2`` built from a config (tiny, CPU) or a pretrained path."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if cfg.pretrained:
        return AutoModelForCausalLM.from_pretrained(cfg.pretrained, torch_dtype=getattr(torch, cfg.dtype))
    torch.manual_seed(cfg.seed)
    conf = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(conf)
    return model.to(getattr(torch, cfg.dtype))
