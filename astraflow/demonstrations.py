"""Multi-turn demonstrations: episodes of a workflow as text segments, for the SFT warm start.

One JSON line per episode. ``astraflow demos`` writes them (``rollout/experts.py`` plays the recipe's own
workflow with a scripted expert, so tool output and observations are exactly what the workflow inserts);
the trainer's warm start reads them (``train/sft.py``, ``sft.demonstrations`` in a recipe):

    {"prompt_id": "q7", "prompt": "capital of Zorbia?\\n",
     "segments": [["<tool>bm25(capital of Zorbia)</tool>", true], ["<result>...</result>", false], ["Quillan", true]],
     "eos": true, "reward": 1.0}

A segment is text and whether the model wrote it (``true``: trained on) or the workflow inserted it
(``false``: tool output, an observation; masked out of the loss, as in a trajectory's ``loss_mask``); an
end-of-turn token inside the episode is written in its segment's text (``</s>`` after an agent's tool call).
``eos``: the episode's last turn ended with the end-of-sequence token. ``reward`` is what the workflow
scored the episode (for reading: a warm start imitates the noisy episodes too).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from astraflow.models import encode_prompt


class Demonstration(BaseModel):
    """One recorded episode of one policy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_id: str
    """The problem it plays (the warm start keeps only training problems)."""
    prompt: str
    """The context before the first turn, as the workflow encoded it."""
    segments: list[tuple[str, bool]]
    """(text, written by the model) in order."""
    eos: bool = True
    reward: float | None = None


def read_demonstrations(path: str | Path) -> list[Demonstration]:
    """Every line of ``path``; a bad line fails with its number."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(Demonstration.model_validate(json.loads(line)))
        except (ValueError, ValidationError) as e:
            raise ValueError(f"{path} line {n}: not a demonstration: {e}") from None
    return out


def write_demonstrations(path: str | Path, demos: Iterable[Demonstration]) -> int:
    lines = [d.model_dump_json() for d in demos]
    Path(path).write_text("".join(f"{line}\n" for line in lines))
    return len(lines)


def segment_ids(tokenizer: Any, text: str) -> list[int]:
    """A segment's token ids: its text as written, an end-of-turn token in it included (``</s>`` after a tool call)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def demonstration_tokens(demo: Demonstration, tokenizer: Any) -> tuple[list[int], list[bool]]:
    """Token ids of the whole episode and, aligned with them, whether each is trained on (model-written)."""
    ids = encode_prompt(tokenizer, demo.prompt)
    trained = [False] * len(ids)
    for text, learn in demo.segments:
        seg = segment_ids(tokenizer, text)
        ids += seg
        trained += [learn] * len(seg)
    if demo.eos:
        ids.append(tokenizer.eos_token_id)
        trained.append(True)
    return ids, trained
