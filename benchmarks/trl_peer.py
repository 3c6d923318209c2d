"""TRL's ``GRPOTrainer`` on a recipe's workload, the peer of ``benchmarks/bench_trl.py``: run with the Python of TRL's
own environment (``benchmarks/trl_env.sh``), never imported by the project.

The same task, split, checkpoint, batch shape (``groups_per_batch`` prompts x ``group_size`` samples a step), sampling
(temperature, top-p 1, top-k 0, ``max_new_tokens``), learning rate, gradient clipping, weight decay and precision
(``trainer.precision``: GRPOConfig's ``bf16`` defaults on, and on a CPU without bf16 instructions TRL trained 53
samples/s with it against 454 without, where the recipe trains in fp32) as the recipe; TRL's own defaults for the rest
(its ``dapo`` loss aggregation, clip 0.2, rewards scaled per group, no KL, gradient checkpointing, torch on every
core). Prompts are encoded as a rollout node encodes them (no end-of-sequence id: ``as_a_node_encodes``, checked
before training), completions decoded and scored by the recipe's verifier. Held-out accuracy is the project's own
evaluator (``evaluate_with_workflow``: greedy, the same held-out prompts), taken on a stopped clock every
``--eval-every`` steps, at the start and at the end.

    .venv-trl/bin/python benchmarks/trl_peer.py --recipe R --checkpoint DIR --seconds 600 --out trl.json
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from astraflow.config import load_recipe
from astraflow.models import build_model, encode_prompt, load_tokenizer, model_limits
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.hf import HFEngine
from astraflow.rollout.evaluator import evaluate_with_workflow, scorable
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.tasks import load_split


class Clock(TrainerCallback):
    """Training time only (evaluations on a stopped clock); held-out every ``every`` steps; stop after ``seconds``."""

    cpu_mark: float

    def __init__(self, seconds: float, every: int, samples_per_step: int, evaluate: Any) -> None:
        self.seconds, self.every, self.per_step, self.evaluate = seconds, every, samples_per_step, evaluate
        self.elapsed, self.mark, self.points, self.steps = 0.0, 0.0, [], 0
        self.cpu = 0.0  # CPU seconds of training (evaluations left out, as their wall time is)

    def point(self, step: int, model: Any) -> None:
        was = model.training
        model.eval()
        held = self.evaluate(model)
        model.train(was)
        self.points.append([step, round(self.elapsed, 2), step * self.per_step, held])

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.point(0, model)
        self.mark, self.cpu_mark = time.perf_counter(), cpu_seconds()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.elapsed += time.perf_counter() - self.mark
        self.cpu += cpu_seconds() - self.cpu_mark
        self.steps = state.global_step
        done = self.elapsed >= self.seconds
        if done or self.steps % self.every == 0:
            self.point(self.steps, model)
        control.should_training_stop = done
        self.mark, self.cpu_mark = time.perf_counter(), cpu_seconds()


def cpu_seconds() -> float:
    """User and system CPU seconds of this process (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def as_a_node_encodes(tokenizer: Any) -> Any:
    """``tokenizer`` as TRL calls it on prompts (``processing_class(text=prompts)``, special tokens on) encoding them as a
    rollout node does (``astraflow.models.encode_prompt``): without the end-of-sequence id ByT5 appends to every encoding.
    Left in, every prompt TRL trains on would end in ``</s>``, a context the evaluator never shows the model."""

    class NoEndOfSequence(type(tokenizer)):  # type: ignore[misc]
        def build_inputs_with_special_tokens(self, ids: list[int], pair: list[int] | None = None) -> list[int]:
            return ids + (pair or [])

    tokenizer.__class__ = NoEndOfSequence
    return tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, required=True)
    ap.add_argument("--checkpoint", type=Path, required=True, help="the SFT warm start both sides start from")
    ap.add_argument("--seconds", type=float, default=600.0, help="training wall time, evaluations excluded")
    ap.add_argument("--eval-every", type=int, default=None, help="default: the recipe's eval.every")
    ap.add_argument("--seed", type=int, default=None, help="the run's seed (trainer.seed; default: the recipe's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from datasets import Dataset  # TRL's environment only (the trl extra, benchmarks/trl_env.sh)
    from trl import GRPOConfig, GRPOTrainer

    recipe = load_recipe(args.recipe, [f"model.pretrained={args.checkpoint}", "sft.steps=0",
                                       *([f"trainer.seed={args.seed}"] if args.seed is not None else [])])
    policy = recipe.primary
    pcfg, rollout, flow, tcfg = recipe.policies[policy], recipe.rollout, recipe.dataflow, recipe.policies[policy].trainer
    torch.manual_seed(tcfg.seed)
    tokenizer = load_tokenizer(pcfg.model.tokenizer)
    model = build_model(pcfg.model, tokenizer)
    tokenizer = as_a_node_encodes(tokenizer)
    reward = get_reward(recipe.reward)
    train, held_out = load_split(recipe.data)
    held_out = scorable(recipe, held_out)
    data = Dataset.from_list([{"prompt": p.prompt, "meta": json.dumps(p.meta)} for p in train])
    for p in train[:100]:  # what TRL will feed the model is what a node feeds it
        if tokenizer(text=[p.prompt])["input_ids"][0] != encode_prompt(tokenizer, p.prompt):
            raise SystemExit(f"TRL would encode {p.prompt!r} otherwise than a rollout node does")

    def verifier(prompts: list[str], completions: list[str], meta: list[str], **_: Any) -> list[float]:
        return [float(reward(c, json.loads(m))) for c, m in zip(completions, meta, strict=True)]

    def evaluate(m: Any) -> float:
        engine = HFEngine(m, tokenizer)
        engine.set_version(0)  # the evaluator's tasks ask for no version
        handle = PolicyHandle(engine, tokenizer, SamplingParams(rollout.max_new_tokens, rollout.temperature,
                              rollout.top_p), name=policy, context=model_limits(pcfg.model).context)
        with torch.no_grad():
            return float(evaluate_with_workflow(recipe, handle, policy, held_out)["reward"])

    per_step = flow.groups_per_batch * flow.group_size
    clock = Clock(args.seconds, args.eval_every or recipe.eval.every, per_step, evaluate)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=per_step, num_generations=flow.group_size,
                            generation_batch_size=per_step, max_completion_length=rollout.max_new_tokens,
                            temperature=rollout.temperature, top_p=rollout.top_p, top_k=0, learning_rate=tcfg.lr,
                            lr_scheduler_type="constant", weight_decay=tcfg.weight_decay, max_grad_norm=tcfg.max_grad_norm,
                            max_steps=10**7, save_strategy="no", report_to=[], use_cpu=True, bf16=tcfg.precision == "bf16",
                            seed=tcfg.seed, disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=verifier, args=config, train_dataset=data, processing_class=tokenizer,
                              callbacks=[clock])
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    args.out.write_text(json.dumps({
        "side": f"TRL GRPOTrainer {__import__('trl').__version__}", "seconds": clock.elapsed, "steps": clock.steps,
        "trained": clock.steps * per_step, "generated": clock.steps * per_step, "points": clock.points,
        "torch_threads": torch.get_num_threads(), "cpu_s": clock.cpu, "wall_s": wall,
        "loss_type": config.loss_type, "epsilon": config.epsilon, "beta": config.beta, "scale_rewards": config.scale_rewards,
        "bf16": config.bf16, "gradient_checkpointing": config.gradient_checkpointing}))


if __name__ == "__main__":
    main()
