"""Tiny transformers models built from a config, and a tokenizer that needs no download.

Both rollout engines and trainers build the same architecture from the recipe's
:class:`~astraflow.config.ModelConfig`; weights then come from the plane (the trainer's
keyframe), so every role agrees bit for bit.

:func:`model_limits` tells a role that never builds the model (the dataflow) what token ids and
row lengths the model takes, from the config and the tokenizer's files, without torch or
transformers.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from astraflow.config import ModelConfig


@lru_cache(maxsize=4)
def load_tokenizer(name: str = "byt5") -> Any:
    """``byt5``: byte-level, file-free, with astraflow's chat template (``chat_template.py``: tools included). Anything
    else is a local path or hub id (GPU recipes), with its own template.

    ``AutoTokenizer`` is imported only for the others: it brings transformers' configuration machinery, which imports
    torch, and a role that only reads text (the dataflow) would pay for it at every start: about 7 s of CPU to load
    ByT5 instead of 2.3 on a 2-core CPU."""
    from astraflow.chat_template import CHAT_TEMPLATE

    if name == "byt5":
        from transformers import ByT5Tokenizer

        tokenizer = ByT5Tokenizer()
        tokenizer.chat_template = CHAT_TEMPLATE
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


@dataclass(frozen=True)
class ByteIds:
    """A byte-level tokenizer's ids (ByT5): byte ``b`` is id ``b + offset``, every other id an added token.

    transformers runs ByT5 in Python: about 60 µs to encode a short prompt and 0.8 µs a decoded id, mostly its machinery
    for added tokens, paid by every node, the dataflow and the evaluator (``benchmarks/bench_tokenizer.py``). Where a
    text holds none of the added tokens' first characters, or ids no added id, the same ids and text come straight
    from the bytes."""

    offset: int
    marks: frozenset[str]  # the first characters of the added tokens: a text with none of them holds none

    def encode(self, text: str) -> list[int] | None:
        """The ids the tokenizer gives ``text``; None where the text may hold an added token (ask the tokenizer)."""
        if any(c in text for c in self.marks):
            return None
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str | None:
        """The text the tokenizer gives ``ids``, none special; None where one is not a byte's id (ask the tokenizer)."""
        low, high = self.offset, self.offset + 256
        if not all(low <= i < high for i in ids):
            return None
        return bytes(i - low for i in ids).decode("utf-8", errors="ignore")


@lru_cache(maxsize=8)
def byte_ids(tokenizer: Any) -> ByteIds | None:
    """ByT5's ids as bytes; None for any other tokenizer, or one that would clean up the decoded text's spaces."""
    from transformers import ByT5Tokenizer

    if not isinstance(tokenizer, ByT5Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    offset, added = tokenizer.offset, tokenizer.get_added_vocab()
    if any(offset <= i < offset + 256 for i in added.values()):
        return None
    return ByteIds(offset, frozenset(token[0] for token in added if token))


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt token ids without the end-of-sequence id ByT5 appends to every encoding."""
    if (by_bytes := byte_ids(tokenizer)) is not None and (fast := by_bytes.encode(text)) is not None:
        return fast
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if ids and tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return list(ids)


@lru_cache(maxsize=8)
def special_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's special token ids, worked out once."""
    return frozenset(tokenizer.all_special_ids)


def decode_text(tokenizer: Any, ids: list[int]) -> str:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, the same text. A python tokenizer (ByT5) works its special ids
    out again on every such call, most of what decoding a short completion costs: here they are dropped by a set made
    once, and ByT5's bytes read as bytes (:class:`ByteIds`). A fast (Rust) tokenizer skips them itself, by its own flags,
    so it is asked as it is."""
    if getattr(tokenizer, "is_fast", True):
        return str(tokenizer.decode(ids, skip_special_tokens=True))
    special = special_ids(tokenizer)
    kept = [i for i in ids if i not in special]
    if (by_bytes := byte_ids(tokenizer)) is not None and (text := by_bytes.decode(kept)) is not None:
        return text
    return str(tokenizer.decode(kept))


BYT5_BYTES = ByteIds(offset=3, marks=frozenset("<"))  # byte_ids(load_tokenizer("byt5")): its added tokens all begin "<"
BYT5_SPECIAL = frozenset([0, 1, 2, *range(259, 384)])  # its special ids: pad, </s>, unk and the 125 extra ids


class TextOf:
    """A tokenizer's prompts as ids and completions as text (:func:`encode_prompt`, :func:`decode_text`, the same
    results), for a role that reads only text (the dataflow's claims). ByT5's byte ids are read without loading it: its
    load imports transformers, about 0.9 s of CPU at every start of a role that would not otherwise need it. Any other
    tokenizer, or a ByT5 text that may hold an added token, is asked itself, loaded the first time it is needed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bytes = BYT5_BYTES if name == "byt5" else None
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.name)
        return self._tokenizer

    def encode_prompt(self, text: str) -> list[int]:
        if self.bytes is not None and (fast := self.bytes.encode(text)) is not None:
            return fast
        return encode_prompt(self.tokenizer, text)

    def decode_text(self, ids: list[int]) -> str:
        if self.bytes is not None and (text := self.bytes.decode([i for i in ids if i not in BYT5_SPECIAL])) is not None:
            return text
        return decode_text(self.tokenizer, ids)


def build_model(cfg: ModelConfig, tokenizer: Any) -> PreTrainedModel:
    """A causal LM from ``cfg``: a pretrained path, or a tiny ``arch`` (``qwen2`` dense, ``qwen3_moe`` experts) built from the config."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if cfg.pretrained:
        return AutoModelForCausalLM.from_pretrained(local_or_hub(cfg.pretrained), torch_dtype=getattr(torch, cfg.dtype))
    torch.manual_seed(cfg.seed)
    common = dict(
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
    conf: Any
    if cfg.arch == "qwen3_moe":
        assert cfg.num_experts and cfg.experts_per_token and cfg.moe_intermediate_size  # ModelConfig fills them in
        # every layer sparse; top-k weights renormalised (as Qwen3-30B-A3B); no router auxiliary loss in RL
        conf = Qwen3MoeConfig(**common, num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                              moe_intermediate_size=cfg.moe_intermediate_size, decoder_sparse_step=1, norm_topk_prob=True,
                              output_router_logits=False)
    else:
        conf = Qwen2Config(**common)
    if cfg.attention_window is not None:  # linear in the row length (window_attention.py)
        from astraflow.window_attention import known_to_transformers

        conf.attention_window = cfg.attention_window
        conf._attn_implementation = known_to_transformers()
    model = Qwen3MoeForCausalLM(conf) if cfg.arch == "qwen3_moe" else Qwen2ForCausalLM(conf)
    return cast("PreTrainedModel", model.to(getattr(torch, cfg.dtype)))


BYT5_VOCAB = 384  # ByT5: 3 special ids + 256 bytes + 125 extra ids (``len(ByT5Tokenizer())``)


@dataclass(frozen=True)
class ModelLimits:
    """What the model of a policy takes: token ids in ``[0, vocab)``, rows of at most ``context`` tokens."""

    vocab: int  # rows of the input embedding
    context: int  # positions the model was built for (prompt + completion)
    experts: int | None = None  # Mixture-of-Experts: experts per layer (None: dense)
    top_k: int | None = None  # experts each position is routed to
    moe_layers: int | None = None  # layers that route (None: not known from the config)


def forward_takes(module: Any, argument: str) -> bool:
    """Whether ``module``'s forward takes ``argument`` (transformers renames them between versions: ``cache`` was
    ``past_key_values``, ``logits_to_keep`` was ``num_logits_to_keep``). Read from its class, which a wrapper set on
    the instance does not hide; a peft model's from the model it adapts, to which it passes its arguments on."""
    unwrap = getattr(module, "get_base_model", None)
    cls: Any = type(unwrap() if callable(unwrap) else module)
    return _forward_takes(cls, argument)


@lru_cache(maxsize=64)
def _forward_takes(cls: Any, argument: str) -> bool:
    return argument in inspect.signature(cls.forward).parameters


def model_limits(cfg: ModelConfig) -> ModelLimits:
    """The embedding size and context of the model ``build_model(cfg, load_tokenizer(cfg.tokenizer))`` makes, cheaply:

    * a pretrained model: ``vocab_size`` and ``max_position_embeddings`` of its ``config.json``
      (a local directory, or the hub id's file in the local cache; ``text_config`` for multimodal ones), and its
      experts (``num_experts`` or ``num_local_experts``, ``num_experts_per_tok``) when it has any;
    * built from the config: the tokenizer's size (``byt5``: 384; a tokenizer's ``tokenizer.json``:
      its highest id + 1, added tokens included), ``max_positions``, and a ``qwen3_moe``'s experts (every layer routes).
    """
    if cfg.pretrained:
        conf = json.loads(_hub_file(cfg.pretrained, "config.json").read_text())
        conf = conf.get("text_config", conf) if "vocab_size" not in conf else conf
        experts = conf.get("num_experts") or conf.get("num_local_experts")
        return ModelLimits(vocab=int(conf["vocab_size"]), context=int(conf.get("max_position_embeddings", cfg.max_positions)),
                           experts=int(experts) if experts else None,
                           top_k=int(conf["num_experts_per_tok"]) if experts and conf.get("num_experts_per_tok") else None)
    moe = {"experts": cfg.num_experts, "top_k": cfg.experts_per_token, "moe_layers": cfg.num_layers} if cfg.arch == "qwen3_moe" else {}
    if cfg.tokenizer == "byt5":
        return ModelLimits(vocab=BYT5_VOCAB, context=cfg.max_positions, **moe)
    vocab = tokenizer_size(_hub_file(cfg.tokenizer, "tokenizer.json", "model.tokenizer"))
    return ModelLimits(vocab=vocab, context=cfg.max_positions, **moe)


def tokenizer_size(path: Path) -> int:
    """``len(tokenizer)`` of a fast tokenizer, from its ``tokenizer.json``: the highest id + 1."""
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # BPE/WordPiece map; Unigram list
    ids += [int(t["id"]) for t in spec.get("added_tokens", [])]
    return max(ids) + 1


def local_or_hub(name: str, field: str = "model.pretrained") -> str:
    """``name`` (a model or tokenizer) as given, once a name written as a path (absolute, or from ``.`` or ``~``) is
    known to be a directory here: a missing one is said as such, not taken for a malformed hub id."""
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        raise FileNotFoundError(f"{field} {name}: no such directory on this machine (a shared base warm-started by "
                                "astraflow up lies in the run directory's base/: copy it to a node on another machine)")
    return str(Path(name).expanduser()) if name.startswith("~") else name


def _hub_file(name: str, filename: str, field: str = "model.pretrained") -> Path:
    """``filename`` of a local model directory, or of a hub id (the local cache first, then a download)."""
    name = local_or_hub(name, field)
    local = Path(name) / filename
    if local.exists():
        return local
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(name, filename)
    return Path(cached) if isinstance(cached, str) else Path(hf_hub_download(name, filename))
