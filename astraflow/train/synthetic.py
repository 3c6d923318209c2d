"""Training batches with real tokens, sampled from a model, for tests and benchmarks.

Completions are sampled token by token from softmax(logits / T) of the given model, and each
token's behaviour logprob is that distribution's log-probability, as a rollout engine reports
it. Advantages are seeded standard-normal draws: these batches exercise the trainer's
mechanics (losses, accumulation, checkpoints), not learning. ``logprob_noise`` perturbs the
behaviour logprobs, as if the tokens came from an older policy (ratios away from 1).

A batch comes with its trajectories in hand (``TrainingBatch``); its manifest's references hold
the trajectories' positions (1, 2, …) until they are published, which gives them their stream
sequences (``tests/test_train_support.publish_batches``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from astraflow.models import encode_prompt
from astraflow.streams.messages import Batch, Trajectory, TrajRef
from astraflow.streams.trajectories import TrainingBatch


@torch.no_grad()
def sample_batches(
    model: torch.nn.Module, tokenizer: Any, prompts: list[str], *, policy: str = "solver", n_batches: int = 1,
    groups_per_batch: int = 2, group_size: int = 4, max_new_tokens: int = 6, temperature: float = 1.0,
    logprob_noise: float = 0.0, seed: int = 0, prefix: str = "b", version: int = 0,
) -> list[TrainingBatch]:
    """``n_batches`` batches; every token is tagged with weight version ``version``."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    model.eval()
    batches = []
    for b in range(n_batches):
        trajs: list[Trajectory] = []
        for g in range(groups_per_batch):
            prompt = prompts[(b * groups_per_batch + g) % len(prompts)]
            p_ids = encode_prompt(tokenizer, prompt)
            seqs = torch.tensor([p_ids] * group_size)  # (G, P)
            logps = []
            for _ in range(max_new_tokens):
                logits = model(input_ids=seqs, use_cache=False).logits[:, -1].float() / temperature  # (G, V)
                logp = torch.log_softmax(logits, -1)  # (G, V)
                tok = torch.multinomial(logp.exp(), 1, generator=gen)  # (G, 1)
                logps.append(logp.gather(-1, tok).squeeze(-1))
                seqs = torch.cat([seqs, tok], 1)
            comp = seqs[:, len(p_ids):]  # (G, T)
            lp = torch.stack(logps, 1)  # (G, T)
            for i in range(group_size):
                n = int(rng.integers(1, max_new_tokens + 1))  # ragged lengths, as with EOS
                blp = lp[i, :n].numpy() + rng.normal(0.0, logprob_noise, n) * (logprob_noise > 0)
                trajs.append(
                    Trajectory(
                        traj_id=f"{prefix}{b}-g{g}.{policy}.{i}",
                        task_id=f"{prefix}{b}-g{g}",
                        prompt_id=f"p{g}",
                        policy=policy,
                        index=i,
                        group_size=group_size,
                        prompt_ids=np.asarray(p_ids, "<i4").tobytes(),
                        completion_ids=comp[i, :n].numpy().astype("<i4").tobytes(),
                        logprobs=blp.astype("<f4").tobytes(),
                        versions=np.full(n, version, "<i4").tobytes(),
                        loss_mask=np.ones(n, "<u1").tobytes(),
                        reward=float(rng.integers(0, 2)),
                    )
                )
        adv = rng.standard_normal(len(trajs)).astype("<f4").tobytes()
        refs = [TrajRef(seq=k + 1, traj_id=t.traj_id, task_id=t.task_id) for k, t in enumerate(trajs)]
        manifest = Batch(batch_id=f"{policy}-{prefix}{b:06d}", policy=policy, refs=refs, advantages=adv,
                         task_ids=sorted({t.task_id for t in trajs}))
        batches.append(TrainingBatch(manifest, trajs))
    return batches
