"""What the OpenAI-compatible facade costs per call, against calling the engine directly, on the tool-calling recipe's model.

The same prompt (the ``calculator-agent`` recipe's chat: its two tools, the system line, a problem) and the same
sampling, three ways: the engine's ``generate`` called directly on the rendered token ids (the baseline: what a
workflow in the node does), and through the facade with the official ``openai`` client, whole and streamed. The
facade's overhead is a call's wall time less the engine time inside it (``GenerateQueue.gen_s``): HTTP, JSON,
the chat template, reading tool calls back, and the recording. Writes ``benchmarks/results/facade.json``.

    python benchmarks/bench_facade.py [--calls 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import openai
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from result_files import write  # noqa: E402

from astraflow.config import load_recipe  # noqa: E402
from astraflow.models import build_model, load_tokenizer  # noqa: E402
from astraflow.rollout.engines.base import GenerationRequest, SamplingParams  # noqa: E402
from astraflow.rollout.engines.hf import HFEngine  # noqa: E402
from astraflow.rollout.workflows.base import PolicyHandle  # noqa: E402
from astraflow.rollout.workflows.openai_facade import ChatFacade  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
         {"type": "function", "function": {"name": "evaluate", "description": "Evaluate an arithmetic expression.", "parameters": {
             "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MESSAGES = [{"role": "system", "content": "Answer with the number."}, {"role": "user", "content": "Compute 347*829+512.\n"}]


def timed(fn: Any, facade: ChatFacade | None) -> tuple[float, float]:
    """(wall s, engine s) of one call."""
    gen0 = facade.gen_s if facade is not None else 0.0
    t0 = time.perf_counter()
    engine_s = fn()
    wall = time.perf_counter() - t0
    return wall, (facade.gen_s - gen0) if facade is not None else engine_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(ROOT / "recipes" / "calculator-agent")
    tok = load_tokenizer("byt5")
    engine = HFEngine(build_model(recipe.policies["solver"].model, tok), tok)
    engine.set_version(0)
    params = SamplingParams(max_new_tokens=recipe.rollout.max_new_tokens, temperature=1.0, seed=0)
    handle = PolicyHandle(engine, tok, params, name="solver")
    facade = ChatFacade({"solver": handle})
    token = facade.open_sample("solver")
    client = openai.OpenAI(base_url=facade.base_url(token), api_key="unused", max_retries=0, timeout=60)
    ids = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    prompt = handle.encode(ids)

    def direct() -> float:
        t0 = time.perf_counter()
        engine.generate([GenerationRequest(prompt, params)])
        return time.perf_counter() - t0

    def whole() -> float:
        client.chat.completions.create(model="solver", messages=MESSAGES, tools=TOOLS)
        return 0.0

    def streamed() -> float:
        for _ in client.chat.completions.create(model="solver", messages=MESSAGES, tools=TOOLS, stream=True):
            pass
        return 0.0

    ways = {"engine.generate, direct": (direct, None), "facade, whole reply": (whole, facade), "facade, streamed": (streamed, facade)}
    for fn, f in ways.values():  # warm up: the first calls build caches and connections
        timed(fn, f)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in track(range(a.calls), description="calls"):
        for name, (fn, f) in ways.items():  # interleaved: the machine's load falls on every way alike
            samples[name].append(timed(fn, f))
    facade.close_sample(token)
    facade.close()
    rows = {}
    for name, xs in samples.items():
        wall = [w for w, _ in xs]
        over = [w - g for w, g in xs]
        rows[name] = {"wall_ms_median": 1e3 * statistics.median(wall), "engine_ms_median": 1e3 * statistics.median(g for _, g in xs),
                      "overhead_ms_median": 1e3 * statistics.median(over), "overhead_ms_p90": 1e3 * sorted(over)[int(0.9 * len(over))]}
    t = Table(title=f"The facade against a direct engine call ({a.calls} calls each, {len(prompt)} prompt tokens)")
    for c in ("way", "wall (median)", "engine inside", "overhead (median)", "overhead (p90)"):
        t.add_column(c)
    for name, r in rows.items():
        t.add_row(name, f"{r['wall_ms_median']:.1f} ms", f"{r['engine_ms_median']:.1f} ms", f"{r['overhead_ms_median']:.2f} ms",
                  f"{r['overhead_ms_p90']:.2f} ms")
    Console().print(t)
    write("facade", {"calls": a.calls, "prompt_tokens": len(prompt), "max_new_tokens": params.max_new_tokens, "ways": rows})


if __name__ == "__main__":
    main()
