"""A local BM25 index over a corpus shipped with a recipe, and the ``bm25`` tool that queries it.

    score(q, d) = Σ_{t ∈ q} idf(t) · f(t,d)·(k1+1) / (f(t,d) + k1·(1 − b + b·|d|/avgdl))
    idf(t) = ln(1 + (N − n(t) + 0.5) / (n(t) + 0.5))

The corpus is a text file with one document per line. A task names it in
``meta["corpus_path"]``, relative to the data file's folder (``meta["data_dir"]``, set by the
JSONL loader). Indexes are built once per process and cached.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

from astraflow.rollout.workflows.tools import TOOLS

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25:
    def __init__(self, docs: list[str], k1: float = 1.5, b: float = 0.75) -> None:
        if not docs:
            raise ValueError("BM25 needs at least one document")
        self.docs = docs
        self.k1, self.b = k1, b
        self.tfs = [Counter(tokenize(d)) for d in docs]
        self.lens = [sum(tf.values()) for tf in self.tfs]
        self.avgdl = sum(self.lens) / len(docs)
        df = Counter(t for tf in self.tfs for t in tf)
        n = len(docs)
        self.idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def scores(self, query: str) -> list[float]:
        terms = tokenize(query)
        out = []
        for tf, dl in zip(self.tfs, self.lens):
            s = 0.0
            for t in terms:
                f = tf.get(t, 0)
                if f:
                    s += self.idf[t] * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * dl / self.avgdl))
            out.append(s)
        return out

    def search(self, query: str, k: int = 1) -> list[str]:
        scores = self.scores(query)
        ranked = sorted(range(len(self.docs)), key=lambda i: (-scores[i], i))
        return [self.docs[i] for i in ranked[:k] if scores[i] > 0]


@lru_cache(maxsize=8)
def load_index(path: str) -> BM25:
    docs = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    return BM25(docs)


def corpus_file(meta: dict[str, Any]) -> str:
    if "corpus_path" not in meta:
        raise ValueError("the bm25 tool needs meta['corpus_path'] (a corpus file next to the recipe's data)")
    p = Path(meta["corpus_path"])
    if not p.is_absolute():
        p = Path(meta.get("data_dir", ".")) / p
    return str(p)


@TOOLS.register("bm25")
def bm25_tool(args: str, meta: dict[str, Any]) -> str:
    """Top document for the query from the task's local BM25 index."""
    hits = load_index(corpus_file(meta)).search(args.strip().strip("\"'"), k=1)
    return hits[0] if hits else "no results"
