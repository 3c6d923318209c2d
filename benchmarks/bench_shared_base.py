"""Many LoRA policies on one node: one merged model per policy (the default) against one base holding every policy's
adapter (``rollout.shared_base``), for 1, 2 and 4 policies of a 32 M-parameter Qwen2 (hidden 512, 8 layers; rank 8 on
the attention projections).

Each configuration runs in a child process that builds a node's handles as ``RolloutNode`` does (``make_handles``) and
reports its resident memory growth, then generates the same work: ``--requests`` prompts per policy, ``--tokens`` new
tokens each, sampled, every policy's requests at once (separate: one batch per policy's engine, the engines taking turns
on the cores; shared: one batch mixing every policy's adapter). Writes ``benchmarks/results/shared_base.json``.

    python benchmarks/bench_shared_base.py [--requests 8] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from result_files import write  # noqa: E402

WIDE = {"hidden_size": 512, "intermediate_size": 2048, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "max_positions": 128}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the adapted layers of the recorded figures


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def child(policies: int, shared: bool, requests: int, tokens: int, repeats: int) -> dict[str, Any]:
    import peft.tuners.lora  # noqa: F401  (imported before the measurement, as transformers is: only the models count)
    import torch
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    from astraflow.config import parse_recipe
    from astraflow.rollout.engines.base import GenerationRequest, SamplingParams
    from astraflow.rollout.node import make_handles

    torch.set_num_threads(2)
    names = [f"p{i}" for i in range(policies)]
    recipe = parse_recipe({"name": "shared", "model": WIDE, "sft": {"steps": 0}, "rollout": {"shared_base": shared},
                           "trainer": {"lora": {"rank": 8, "alpha": 16, "target_modules": ATTENTION}}, "policies": {n: {} for n in names}})
    before = rss_mib()
    handles = make_handles(recipe)
    grown = rss_mib() - before
    tok = handles[names[0]].tokenizer
    prompts = [list(tok.encode(f"{i}+{i + 3}=", add_special_tokens=False)) for i in range(requests)]
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if shared:  # one engine: every policy's requests in one batch
            engine: Any = handles[names[0]].engine.shared.engine
            engine.generate([GenerationRequest(p, params, n) for n in names for p in prompts])
        else:
            for n in names:
                handles[n].engine.generate([GenerationRequest(p, params) for p in prompts])
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    return {"policies": policies, "shared_base": shared, "rss_growth_mib": round(grown, 1), "generate_s": round(wall, 3),
            "tokens_per_s": round(policies * requests * tokens / wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], bool(a.child[1]), a.requests, a.tokens, a.repeats)))
        return
    rows = []
    for policies in (1, 2, 4):
        for shared in (0, 1):
            out = subprocess.run([sys.executable, __file__, "--child", str(policies), str(shared), "--requests", str(a.requests),
                                  "--tokens", str(a.tokens), "--repeats", str(a.repeats)],
                                 check=True, capture_output=True, text=True, cwd=ROOT)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    t = Table(title="LoRA policies on one node: a merged model each, or one shared base")
    for c in ("policies", "node holds", "memory", "generation (median)", "tokens/s"):
        t.add_column(c)
    for r in rows:
        t.add_row(str(r["policies"]), "one base + adapters" if r["shared_base"] else "a model per policy",
                  f"{r['rss_growth_mib']:.0f} MiB", f"{r['generate_s']:.2f} s", f"{r['tokens_per_s']:.0f}")
    Console().print(t)
    write("shared_base", {"model": WIDE, "rank": 8, "requests": a.requests, "tokens": a.tokens, "repeats": a.repeats, "rows": rows})


if __name__ == "__main__":
    main()
