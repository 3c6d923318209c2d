"""Partial rollouts on the ``hf`` engine: a weight version loaded while a generation runs lands between two decoding
steps; the tokens after it carry the new version and the new weights' logprobs, which is what the trainer's
per-token correction (behaviour logprobs, M2PO/TIS) reads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from astraflow.config import ModelConfig, RolloutConfig
from astraflow.models import build_model, load_tokenizer
from astraflow.rollout.engines.base import Completion, GenerationRequest, SamplingParams
from astraflow.rollout.engines.hf import HFEngine
from astraflow.rollout.node_report import NODE_STATS, NodeReport
from astraflow.streams.messages import Batch, TrajRef
from astraflow.streams.trajectories import TrainingBatch
from astraflow.train.batching import to_tensors
from astraflow.train.losses.functional import gather_logprobs
from tests.factories import a_trajectory

TOK = load_tokenizer("byt5")
TINY = ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
PROMPT = [10, 11, 12, 13]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_model(TINY.model_copy(update={"seed": seed}), TOK).state_dict().items()}


def policy(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = build_model(TINY, TOK)
    model.load_state_dict(state)
    return model.eval()


def load_during_step(engine: HFEngine, step: int, state: dict[str, torch.Tensor], version: int) -> threading.Thread:
    """Start loading ``version`` while decoding step ``step`` of the next generation runs: the load is waiting for the
    engine before that step ends (as a node's weight watcher would be)."""
    forward, calls = engine.model.forward, [0]
    loader = threading.Thread(target=engine.load_state, args=(state, version))

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] == step:
            loader.start()
            while engine._loads_waiting == 0:
                time.sleep(0.001)
        return forward(*args, **kwargs)

    engine.model.forward = counted
    return loader


def teacher_forced(model: torch.nn.Module, completion: list[int]) -> torch.Tensor:
    """log π(token t | prompt, tokens < t) of every completion token under ``model``."""
    ids = torch.tensor([PROMPT + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(PROMPT):, None]).squeeze(-1)


@pytest.fixture(scope="module")
def switched() -> tuple[Completion, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    old, new = weights(3), weights(5)
    engine = HFEngine(build_model(TINY, TOK), TOK, partial_rollouts=True)
    engine.load_state(old, 1)
    loader = load_during_step(engine, 6, new, 2)
    [c] = engine.generate([GenerationRequest(PROMPT, GREEDY)])
    loader.join(30)
    assert engine.version == 2 and engine.switches == 1
    return c, old, new


def test_a_load_lands_between_decoding_steps(switched):
    c, _, _ = switched
    k = c.versions.count(1)
    assert k >= 1 and len(c.token_ids) > k, f"no switch inside the generation: {c.versions}"
    assert c.versions == [1] * k + [2] * (len(c.token_ids) - k)  # each token the version that sampled it
    assert len(c.token_ids) == len(c.logprobs)


def test_tokens_and_logprobs_are_those_of_the_weights_that_sampled_them(switched):
    """Greedy: every token is the argmax of the weights its version names, given everything before it (the new
    weights recompute the prefix), and its behaviour logprob is theirs."""
    c, old, new = switched
    k = c.versions.count(1)
    by_old, by_new = teacher_forced(policy(old), c.token_ids), teacher_forced(policy(new), c.token_ids)
    behave = torch.tensor(c.logprobs)
    assert torch.allclose(behave[:k], by_old[:k], atol=1e-4)
    assert torch.allclose(behave[k:], by_new[k:], atol=1e-4)
    assert not torch.allclose(behave[k:], by_old[k:], atol=1e-2)  # the switch changed what the tokens were scored by


def test_the_trainer_corrects_each_token_against_its_own_version(switched):
    """A trainer holding the new version reads ratio 1 on the tokens the new version sampled and π_new/π_old on the
    others: the per-token importance weights of M2PO/TIS are right across the switch."""
    c, old, new = switched
    n, k = len(c.token_ids), c.versions.count(1)
    t = a_trajectory(prompt_ids=PROMPT, completion_ids=np.asarray(c.token_ids, np.int32),
                     logprobs=np.asarray(c.logprobs, np.float32), versions=np.asarray(c.versions, np.int32),
                     loss_mask=np.ones(n, np.uint8))
    manifest = Batch(batch_id="solver-b000001", policy="solver", refs=[TrajRef(seq=1, traj_id=t.traj_id, task_id=t.task_id)],
                     advantages=np.ones(1, np.float32), task_ids=[t.task_id])
    x = to_tensors(TrainingBatch(manifest, [t]), TOK.pad_token_id)
    with torch.no_grad():
        logits = policy(new)(input_ids=x.input_ids, attention_mask=x.attention_mask).logits
    current = gather_logprobs(logits.gather(1, x.logit_index[..., None].expand(-1, -1, logits.shape[-1])), x.targets)[0]
    ratio = torch.exp(current - x.behave_logprobs[0])
    assert x.versions[0].tolist() == c.versions
    assert torch.allclose(ratio[k:], torch.ones(n - k), atol=1e-3)
    expected = torch.exp(teacher_forced(policy(new), c.token_ids)[:k] - teacher_forced(policy(old), c.token_ids)[:k])
    assert torch.allclose(ratio[:k], expected, rtol=1e-3)


def test_without_partial_rollouts_a_load_waits_for_the_generation():
    engine = HFEngine(build_model(TINY, TOK), TOK)
    engine.load_state(weights(3), 1)
    loader = load_during_step(engine, 3, weights(5), 2)
    [c] = engine.generate([GenerationRequest(PROMPT, GREEDY)])
    loader.join(30)
    assert set(c.versions) == {1} and engine.version == 2 and engine.switches == 0


def test_a_switch_keeps_every_row_of_a_batch_and_its_length_budget():
    """Rows of a batch that finished before the switch stay as they were; the others go on, none past
    max_new_tokens; sampled (not greedy) rows too."""
    engine = HFEngine(build_model(TINY, TOK), TOK, partial_rollouts=True)
    engine.load_state(weights(3), 1)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    loader = load_during_step(engine, 4, weights(5), 2)
    out = engine.generate([GenerationRequest(p, params) for p in ([10, 11], [12], [13, 14, 15], [16])])
    loader.join(30)
    for c in out:
        assert 1 <= len(c.token_ids) <= 12 and len(c.logprobs) == len(c.versions) == len(c.token_ids)
        assert c.versions == sorted(c.versions) and set(c.versions) <= {1, 2}
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == TOK.eos_token_id
        else:  # the budget, or a pad token sampled (cut there, as without a switch)
            assert len(c.token_ids) == 12 or c.token_ids.count(TOK.eos_token_id) == 0
    assert any(2 in c.versions for c in out)


def test_partial_rollouts_is_refused_for_an_engine_that_cannot_switch():
    with pytest.raises(ValueError, match="partial_rollouts: engine sglang cannot switch"):
        RolloutConfig(partial_rollouts=True, engine={"type": "sglang", "url": "http://127.0.0.1:1"})
    assert RolloutConfig(partial_rollouts=True, engine={"type": "vllm", "mode": "inprocess"}).partial_rollouts
    assert RolloutConfig(partial_rollouts=True).engine.type == "hf"


def test_a_node_counts_the_trajectories_whose_tokens_switched_version():
    report = NodeReport(dict.fromkeys(NODE_STATS, 0.0), weights=None, metrics=None)  # type: ignore[arg-type]
    mixed = a_trajectory(index=0, n=3, versions=np.asarray([1, 1, 2], np.int32))
    inserted = a_trajectory(index=1, n=3, versions=np.asarray([-1, 2, 2], np.int32), loss_mask=np.asarray([0, 1, 1], np.uint8))
    report.done([mixed, inserted, a_trajectory(index=2, n=3, version=2)])
    assert report.stats["switched"] == 1 and report.stats["trajectories"] == 3  # a tool's output (v-1, not trained) is no switch
