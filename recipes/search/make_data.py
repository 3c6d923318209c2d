"""Made-up facts for the CPU `search` recipe, and its noisy demonstrations.

Writes, next to this file:

- ``corpus.txt``: two facts about each made-up country, one a line ("The capital of Zorbia is Quillan.");
- ``questions.jsonl``: one question per country about one of its facts ("capital of Zorbia?"), with the answer and
  the corpus the ``bm25`` tool searches. No country is asked about twice, so a held-out question names a
  country no training question names, and its answer is a word the model never saw in training: only a
  search finds it;
- ``demos.jsonl``: the warm start's episodes, played through the recipe's own workflow (the real ``bm25``
  tool inserts the results) by a noisy demonstrator. A careful one searches the whole question and copies
  the answer from the result. A careless one searches the country's name alone, which finds one of the
  country's two facts, the asked one half of the time, and copies whatever it found; now and then it
  answers from memory with a name it has seen (wrong).

Run: ``python recipes/search/make_data.py`` (deterministic).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from astraflow.config import load_recipe
from astraflow.demonstrations import write_demonstrations
from astraflow.rollout.experts import Expert, record
from astraflow.streams.messages import Task
from astraflow.tasks import load_split

HERE = Path(__file__).resolve().parent
COUNTRIES, RELATIONS = 500, ("capital", "founder")
CAREFUL, GUESS = 0.3, 0.1  # shares of careful demonstrations and of answers from memory; the rest search the name
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"


def made_up_names(rng: random.Random, n: int, taken: set[str]) -> list[str]:
    """``n`` new pronounceable 5-letter words (consonant, vowel, consonant, vowel, consonant), none in ``taken``."""
    out: list[str] = []
    while len(out) < n:
        word = "".join(rng.choice(CONSONANTS if i % 2 == 0 else VOWELS) for i in range(5)).capitalize()
        if word not in taken:
            taken.add(word)
            out.append(word)
    return out


def careful_or_careless(rng: random.Random, memory: list[str]) -> Expert:
    draw = rng.random()
    careful, guess = draw < CAREFUL, draw >= 1 - GUESS

    def expert(task: Task, context: str) -> str:
        question = task.prompt.strip().rstrip("?")
        if guess:
            return rng.choice(memory)
        found = re.search(r"<result>.* is (\w+)\.</result>$", context)
        query = question if careful else question.split()[-1]
        return found.group(1) if found else f"<tool>bm25({query})</tool>"

    return expert


def main() -> None:
    rng = random.Random(0)
    taken: set[str] = set()
    countries = made_up_names(rng, COUNTRIES, taken)
    corpus, rows = [], []
    for i, country in enumerate(countries):
        values = dict(zip(RELATIONS, made_up_names(rng, len(RELATIONS), taken)))
        corpus += [f"The {rel} of {country} is {value}." for rel, value in values.items()]
        rel = rng.choice(RELATIONS)
        rows.append({"id": f"f{i}", "prompt": f"{rel} of {country}?\n", "answer": values[rel], "corpus_path": "corpus.txt"})
    rng.shuffle(corpus)
    (HERE / "corpus.txt").write_text("".join(f"{line}\n" for line in corpus))
    (HERE / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = load_recipe(HERE)
    train, _ = load_split(recipe.data)
    memory = [p.meta["answer"] for p in train]
    demos = record(recipe, {recipe.primary: lambda r: careful_or_careless(r, memory)}, train, per_problem=2, seed=0)
    n = write_demonstrations(HERE / "demos.jsonl", demos[recipe.primary])
    print(f"{len(rows)} questions, {len(corpus)} facts, {n} demonstrations")


if __name__ == "__main__":
    main()
