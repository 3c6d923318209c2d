"""The dataflow's checks of what a node claims (``dataflow/claims.py``), as pure functions: a trajectory's prompt against
the task it was issued with and the run's prompts, its reward against the reward's range and the reward scored again
from its completion; which roles of a workflow are checked how; the sampled re-scoring of a costly reward."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from factories import BYT5, a_task, a_trajectory, honest

from astraflow.config import parse_recipe
from astraflow.dataflow import reading
from astraflow.dataflow.claims import FREE, ClaimCheck, role_claims, sampled
from astraflow.dataflow.inflight import InFlight
from astraflow.dataflow.reputation import Reputation
from astraflow.models import BYT5_BYTES, BYT5_SPECIAL, TextOf, byte_ids, decode_text, encode_prompt, special_ids
from astraflow.registry import REWARDS, Claims
from astraflow.rollout.rewards import costly, range_of, reward_range
from astraflow.tasks import Problem, load_split


def run(**over: Any):
    data: dict[str, Any] = {"name": "t", "policies": ["solver"], "data": {"n_train": 30, "n_eval": 5}, **over}
    return parse_recipe(data)


@pytest.fixture(scope="module")
def check() -> tuple[ClaimCheck, Problem]:
    r = run()
    train, _ = load_split(r.data)
    return ClaimCheck(r, train), train[0]


def sample(problem: Problem, reward: float | None = None, correct: bool = True, **over: Any):
    task = a_task(1, prompt=problem.prompt, answer=problem.meta["answer"], prompt_id=problem.prompt_id)
    arrays = honest(task, 1.0 if correct else 0.0)
    fields: dict[str, Any] = {**arrays, "prompt_id": problem.prompt_id, "reward": float(correct) if reward is None else reward}
    fields.update(over)
    n = len(fields["completion_ids"])
    return a_trajectory(1, 0, n=n, **fields)


def test_an_honest_sample_passes_and_is_scored_again(check):
    c, p = check
    before = c.cost.rescored
    assert c.check(sample(p, correct=True), p.prompt_id) is None
    assert c.check(sample(p, correct=False), p.prompt_id) is None
    assert c.check(sample(p, correct=True), None) is None  # a task issued before a restart: its prompt_id is its own
    assert c.cost.rescored == before + 3


@pytest.mark.parametrize(("over", "issued", "code", "says"), [
    ({"reward": 1.0, "correct": False}, None, "reward_claim", "reward 1 claimed, its completion scores 0"),
    ({"reward": 0.0, "correct": True}, None, "reward_claim", "reward 0 claimed, its completion scores 1"),
    ({"reward": 1e29}, None, "reward_range", "outside [0, 1]"),
    ({"reward": -0.5, "correct": False}, None, "reward_range", "outside [0, 1]"),
    ({"prompt_ids": np.asarray(encode_prompt(BYT5, "9+9="), np.int32)}, None, "prompt_claim", "not the tokens of prompt"),
    ({"prompt_id": "add-9-9x"}, None, "prompt_claim", "not one of the run's prompts"),
    ({}, "add-other", "prompt_claim", "its task was issued with 'add-other'"),
])
def test_a_lie_is_named(check, over: dict[str, Any], issued: str | None, code: str, says: str):
    c, p = check
    correct = over.pop("correct", True)
    bad = c.check(sample(p, correct=correct, **over), issued)
    assert bad is not None and bad.code == code and says in bad.detail, bad


def test_an_explicit_failure_carries_no_reward_to_check(check):
    c, p = check
    assert c.check(sample(p, reward=None, correct=False, finish_reason="error"), p.prompt_id) is None


def test_each_role_of_a_workflow_is_checked_as_it_declares():
    single = role_claims(run())
    assert single == {"solver": Claims(prompt="issued", reward="rescored")}
    pair = role_claims(run(policies=["solver", "verifier"], workflow="solver_verifier"))
    assert pair["solver"].reward == "rescored" and pair["verifier"] == Claims(reward="bounded", reward_range=(0.0, 1.0))
    env = role_claims(run(workflow={"type": "env_http", "url": "bundled"}))
    assert env == {"solver": FREE}  # the environment writes the prompt and is the verifier


def test_a_partner_outside_its_range_is_refused_and_its_own_prompt_is_free():
    r = run(policies=["solver", "verifier"], workflow="solver_verifier")
    train, _ = load_split(r.data)
    c, p = ClaimCheck(r, train), train[0]
    verdict = dict(policy="verifier", traj_id="t00000001.verifier.0", prompt_ids=np.arange(5, 40, dtype=np.int32))
    assert c.check(sample(p, **verdict), p.prompt_id) is None  # a prompt built from the solver's answer
    bad = c.check(sample(p, reward=2.0, **verdict), p.prompt_id)
    assert bad is not None and bad.code == "reward_range"


def test_a_reward_without_a_range_gets_the_documented_default_and_a_costly_one_is_sampled():
    @REWARDS.register("claims_test_costly")
    @costly
    def graded(text: str, meta: dict[str, Any]) -> float:
        return 0.5 if text.strip() == str(meta["answer"]) else -0.5

    try:
        assert range_of(graded) == (-1.0, 1.0)
        assert range_of(reward_range(0, 10)(lambda t, m: 0.0)) == (0.0, 10.0)
        r = run(reward="claims_test_costly", dataflow={"rescore_costly": 0.25})
        train, _ = load_split(r.data)
        c = ClaimCheck(r, train, key=b"k" * 16)
        p = train[0]
        picked = [k for k in range(400) if sampled(c.key, f"t{k:08d}.solver.0", 0.25)]
        assert 60 < len(picked) < 140  # about a quarter
        lie = [sample(p, reward=0.5, correct=False, traj_id=f"t{k:08d}.solver.0", task_id=f"t{k:08d}") for k in range(400)]
        found = c.check_all([(t, p.prompt_id) for t in lie])
        assert [k for k, bad in enumerate(found) if bad is not None] == picked  # exactly the sampled ones are scored again
        assert c.cost.rescored == len(picked) and c.cost.by_code == {"reward_claim": len(picked)}
        assert c.check(sample(p, reward=2.0, correct=False), p.prompt_id).code == "reward_range"  # type: ignore[union-attr]
    finally:
        REWARDS.unregister("claims_test_costly")


def test_a_reward_that_raises_on_the_completion_is_not_believed():
    @REWARDS.register("claims_test_raises")
    def fussy(text: str, meta: dict[str, Any]) -> float:
        raise ValueError("cannot read it")

    try:
        r = run(reward="claims_test_raises")
        train, _ = load_split(r.data)
        bad = ClaimCheck(r, train).check(sample(train[0], reward=0.0, correct=False), train[0].prompt_id)
        assert bad is not None and bad.code == "reward_claim" and "ValueError: cannot read it" in bad.detail
    finally:
        REWARDS.unregister("claims_test_raises")


def test_trust_claims_is_a_recipe_switch():
    assert run().dataflow.trust_claims is False
    assert run(dataflow={"trust_claims": True}).dataflow.trust_claims is True
    with pytest.raises(ValueError, match="rescore_costly"):
        run(dataflow={"rescore_costly": 1.5})


def test_a_prompt_id_a_source_repeats_is_checked_against_each_of_its_prompts():
    r = run()
    twins = [Problem("q", "1+2=", {"answer": "3"}), Problem("q", "2+2=", {"answer": "4"})]
    c = ClaimCheck(r, twins)
    for p, answer in ((twins[0], "3"), (twins[1], "4")):
        assert c.check(sample(p, correct=True), "q") is None  # scored with the meta of the prompt it answered
        lie = c.check(sample(p, reward=1.0, correct=False), "q")
        assert lie is not None and lie.code == "reward_claim", answer
    other = sample(twins[0], prompt_ids=np.asarray(encode_prompt(BYT5, "5+5="), np.int32))
    assert c.check(other, "q").code == "prompt_claim"  # type: ignore[union-attr]


def test_a_completion_is_decoded_to_the_text_the_tokenizer_gives_without_its_special_tokens():
    rng = np.random.default_rng(0)
    special = sorted(BYT5.all_special_ids)
    for _ in range(200):
        ids = [int(i) for i in rng.integers(0, len(BYT5), int(rng.integers(0, 24)))] + [int(rng.choice(special))]
        rng.shuffle(ids)
        assert decode_text(BYT5, ids) == TextOf("byt5").decode_text(ids) == BYT5.decode(ids, skip_special_tokens=True)
    assert decode_text(BYT5, [*BYT5.encode("7+8=15"), BYT5.eos_token_id, BYT5.pad_token_id]) == "7+8=15"
    assert decode_text(BYT5, [*BYT5.encode("é")[:1], 70]) == BYT5.decode([*BYT5.encode("é")[:1], 70])  # a cut character


def test_a_prompt_is_encoded_to_the_ids_the_tokenizer_gives_with_or_without_its_added_tokens():
    rng = np.random.default_rng(0)
    pieces = ["12", "+", " ", "\n", "\t", "é", "ß", "中", "🙂", "\x00", "<", ">", "</s>", "<pad>", " <unk> ", "<extra_id_7>",
              "<extra_id_", "s>"]
    for _ in range(300):
        text = "".join(rng.choice(pieces, int(rng.integers(0, 12))))
        ids = BYT5(text, add_special_tokens=False)["input_ids"]
        want = ids[:-1] if ids and ids[-1] == BYT5.eos_token_id else ids
        assert encode_prompt(BYT5, text) == TextOf("byt5").encode_prompt(text) == want, repr(text)
    assert encode_prompt(BYT5, "7+8=") == [b + 3 for b in b"7+8="]


def test_byt5s_bytes_are_read_as_the_tokenizer_has_them_without_loading_it():
    """What ``TextOf`` knows of ByT5 without loading it is what the tokenizer says; the dataflow's claims of a byte-level
    run are checked without importing transformers (its load was about 0.9 s of CPU at every start)."""
    assert byte_ids(BYT5) == BYT5_BYTES and special_ids(BYT5) == BYT5_SPECIAL
    probe = ("import sys; from astraflow.config import parse_recipe; from astraflow.dataflow.claims import ClaimCheck; "
             "from astraflow.tasks import load_split; r = parse_recipe({'name': 't', 'data': {'n_train': 30}}); "
             "train, _ = load_split(r.data); c = ClaimCheck(r, train); "
             "assert c.prompt_tokens('solver', train[0]) and c.texts['solver'].decode_text([58, 59, 1]) == '78'; "
             "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


@dataclass
class Sent:
    subject: str = "af.run.traj.solver.node-0"  # a delivery as a node's credential publishes it


async def test_a_pull_whose_checks_are_cheap_is_checked_on_the_loop_and_a_costly_one_in_a_worker_thread(monkeypatch):
    r = run()
    train, _ = load_split(r.data)
    claims = ClaimCheck(r, train)
    threaded: list[int] = []
    to_thread = asyncio.to_thread

    async def counted(f: Any, items: list[Any]) -> Any:
        threaded.append(len(items))
        return await to_thread(f, items)

    monkeypatch.setattr(reading.asyncio, "to_thread", counted)
    reader = reading.PullReader(None, claims, InFlight(), {"solver"}, Reputation(0), Counter())  # type: ignore[arg-type]
    honest_one, lie = sample(train[0], correct=True), sample(train[0], reward=1.0, correct=False)
    assert await reader.check_claims([(Sent(), honest_one, None)]) == [None]  # no cost known yet: a thread
    assert threaded == [1]
    found = await reader.check_claims([(Sent(), honest_one, None), (Sent(), lie, None)] * 2)
    assert threaded == [1] and [f is None for f in found] == [True, False] * 2  # cheap: on the loop, the same verdicts
    claims.cost.check_s += 10 * reading.INLINE_S * claims.cost.checked  # as a costly reward's checks would measure
    assert await reader.check_claims([(Sent(), lie, None)]) != [None]
    assert threaded == [1, 1]


def test_a_pull_scores_each_completion_once_against_each_samples_own_claim_and_encodes_each_prompt_once(monkeypatch):
    calls: Counter[str] = Counter()

    @REWARDS.register("claims_test_counted")
    @reward_range(0, 1)
    def counted(text: str, meta: dict[str, Any]) -> float:
        calls[text] += 1
        return float(text.strip() == str(meta["answer"]))

    encoded: Counter[str] = Counter()
    real_encode = TextOf.encode_prompt

    def counting_encode(self: TextOf, text: str) -> list[int]:
        encoded[text] += 1
        return real_encode(self, text)

    monkeypatch.setattr(TextOf, "encode_prompt", counting_encode)
    try:
        r = run(reward="claims_test_counted")
        train, _ = load_split(r.data)
        c, p = ClaimCheck(r, train), train[0]
        right, wrong = (sample(p, correct=True, traj_id=f"t00000001.solver.{k}") for k in (0, 1))
        lie = sample(p, reward=1.0, correct=False, traj_id="t00000001.solver.2")  # wrong's completion, claimed right
        again = sample(p, correct=True, traj_id="t00000001.solver.3")
        found = c.check_all([(t, p.prompt_id) for t in (right, wrong, lie, again)])
        assert [bad and bad.code for bad in found] == [None, None, "reward_claim", None]
        assert sorted(calls.values()) == [1, 1]  # two distinct completions, each scored once
        assert c.cost.rescored == 4  # every sample's claim was checked
        for q in train:  # the run's prompts, twice over: each encoded once
            for _ in range(2):
                c.check_all([(sample(q, correct=True), q.prompt_id)])
        assert set(encoded.values()) == {1} and len(encoded) == len({q.prompt for q in train})
        bound = 3 * max(len(c.prompt_tokens("solver", q)) for q in train)
        monkeypatch.setattr("astraflow.dataflow.claims.PROMPT_CACHE_BYTES", bound)  # room for three prompts or so
        small = ClaimCheck(r, train)
        small.check_all([(sample(q, correct=True), q.prompt_id) for q in train])
        assert 0 < sum(map(len, small._prompts["solver"].values())) <= bound  # the least recently used dropped
        encoded.clear()
        small.check_all([(sample(q, correct=True), q.prompt_id) for q in train[:6]])
        assert set(encoded) == {q.prompt for q in train[:6]}  # dropped long ago: encoded again
    finally:
        REWARDS.unregister("claims_test_counted")
