"""The pure checks of the trust boundary, without a server: trajectories (dataflow), batches and
weights (trainer), announcements (nodes), the version floors tasks were issued with, and the
model limits the dataflow computes without building the model."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import torch
from factories import a_trajectory
from hypothesis import given, settings
from hypothesis import strategies as st

from astraflow.config import ModelConfig, parse_recipe
from astraflow.dataflow.inflight import RECENT, Floors, InFlight
from astraflow.dataflow.ledger import Ledger, account
from astraflow.dataflow.lifecycle import Stage, TaskBook
from astraflow.dataflow.validate import LOGPROB_SLACK, Limits, PolicyLimits, check_trajectory, check_versions
from astraflow.models import build_model, load_tokenizer, model_limits
from astraflow.streams.codec import decode, encode
from astraflow.streams.fates import DROPPED_STALE, TRAINED, Fate, Outcome
from astraflow.streams.messages import Batch, ObjectRef, Trajectory, TrajRef, WeightVersion
from astraflow.streams.trajectories import TrainingBatch
from astraflow.train.vetting import check_batch, check_manifest
from astraflow.weights.checks import announcement_problem, order_problem
from astraflow.weights.delta import to_bf16_state
from astraflow.weights.finite import FiniteState, checked, non_finite

VOCAB, GROUP = 384, 4
LIMITS = PolicyLimits(vocab=VOCAB, max_completion=16, max_generated=16, max_row=None)
MULTI = PolicyLimits(vocab=VOCAB, max_completion=None, max_generated=12, max_row=40)


def traj(n: int = 6, *, task: str = "t00000001", policy: str = "solver", index: int = 0, reward: float | None = 1.0,
         finish: str = "stop", version: int = 3, **over: object) -> Trajectory:
    defaults = {"group_size": GROUP, "prompt_ids": np.arange(1, 5), "logprob": -0.7, "finish_reason": finish}
    return a_trajectory(task, index, policy=policy, n=n, version=version, reward=reward, **{**defaults, **over})


@st.composite
def valid_trajectories(draw: st.DrawFn) -> tuple[Trajectory, PolicyLimits, int, int]:
    multi = draw(st.booleans())
    limits = MULTI if multi else LIMITS
    n_prompt = draw(st.integers(1, 20))
    n = draw(st.integers(0, 20 if multi else limits.max_completion or 0))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)) if multi else [1] * n
    if multi:
        mask = [m if sum(mask[: i + 1]) <= limits.max_generated else 0 for i, m in enumerate(mask)]
        n = min(n, (limits.max_row or 0) - n_prompt)
        mask = mask[:n]
    floor, newest = draw(st.integers(0, 5)), draw(st.integers(5, 9))
    versions = [draw(st.integers(floor, newest)) if m else draw(st.integers(-1, newest)) for m in mask]
    logprobs = [draw(st.floats(-30.0, 0.0, width=32)) if m else 0.0 for m in mask]
    index = draw(st.integers(0, GROUP - 1))
    t = Trajectory(traj_id=f"t00000007.solver.{index}", task_id="t00000007", prompt_id="p", policy="solver", index=index, group_size=GROUP,
                   prompt_ids=np.asarray(draw(st.lists(st.integers(0, VOCAB - 1), min_size=n_prompt, max_size=n_prompt)), np.int32),
                   completion_ids=np.asarray(draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)), np.int32),
                   logprobs=np.asarray(logprobs, np.float32), versions=np.asarray(versions, np.int32), loss_mask=np.asarray(mask, np.uint8),
                   reward=draw(st.floats(-1e6, 1e6)), finish_reason=draw(st.sampled_from(["stop", "length", "error"])))
    return t, limits, floor, newest


@settings(max_examples=200, deadline=None)
@given(valid_trajectories())
def test_what_a_node_may_send_passes(case: tuple[Trajectory, PolicyLimits, int, int]):
    t, limits, floor, newest = case
    assert check_trajectory(t, limits, GROUP) is None
    assert check_versions(t, floor, newest) is None


CORRUPTIONS = {  # code -> trajectories that must be turned away with it
    "traj_id": [traj(traj_id="t00000001.solver.1"), traj(traj_id="anything")],
    "group_size": [traj(group_size=8)],
    "index": [traj(index=4, traj_id="t00000001.solver.4")],  # a negative index is refused by the wire model itself
    "reward": [traj(reward=math.nan), traj(reward=math.inf), traj(reward=-math.inf), traj(reward=1e31), traj(reward=None)],
    "time": [traj(created_at=math.nan)],
    "prompt": [traj(prompt_ids=np.zeros(0, np.int32))],
    "token": [traj(completion_ids=np.array([1, 2, 3, 4, 5, VOCAB])), traj(completion_ids=np.array([1, 2, 3, 4, 5, -1])),
              traj(prompt_ids=np.array([1, VOCAB + 7]))],
    "length": [traj(17, logprobs=np.full(17, -0.5, np.float32))],
    "mask": [traj(loss_mask=np.array([1, 1, 2, 1, 1, 1], np.uint8))],
    "logprob": [traj(logprobs=np.array([-0.5, math.nan, -1, -1, -1, -1], np.float32)),
                traj(logprobs=np.array([-0.5, -math.inf, -1, -1, -1, -1], np.float32)),
                traj(logprobs=np.array([-0.5, 0.5, -1, -1, -1, -1], np.float32))],
}


@pytest.mark.parametrize("code,bad", [(c, t) for c, ts in CORRUPTIONS.items() for t in ts])
def test_each_bad_value_is_named(code: str, bad: Trajectory):
    got = check_trajectory(bad, LIMITS, GROUP)
    assert got is not None and got.code == code and got.reason.startswith(f"invalid {code}: ")


def test_explicit_failure_and_rounding_are_not_errors():
    assert check_trajectory(traj(reward=None, finish="error"), LIMITS, GROUP) is None  # an explicit failure is a valid sample
    assert check_trajectory(traj(logprobs=np.full(6, LOGPROB_SLACK / 2, np.float32)), LIMITS, GROUP) is None  # rounding above 0
    assert check_trajectory(traj(0), LIMITS, GROUP) is None  # an empty completion


def test_multi_turn_limits_count_generated_tokens_and_the_row():
    tool = np.array([1] * 6 + [0] * 20 + [1] * 6, np.uint8)  # 12 generated tokens around tool output
    ok = traj(32, loss_mask=tool, logprobs=np.where(tool == 1, -0.5, 0.0).astype(np.float32))
    assert check_trajectory(ok, MULTI, GROUP) is None  # 4 + 32 tokens <= 40, 12 generated <= 12
    assert check_trajectory(ok, LIMITS, GROUP).code == "length"  # single-turn: 32 > 16 completion tokens
    more = np.array([1] * 13 + [0] * 19, np.uint8)
    assert check_trajectory(traj(32, loss_mask=more), MULTI, GROUP).code == "length"
    assert check_trajectory(traj(37), MULTI, GROUP).code == "length"  # 4 + 37 > 40


def test_versions_lie_in_the_task_window():
    assert check_versions(traj(version=3), floor=3, newest=3) is None
    assert check_versions(traj(version=4), floor=0, newest=3).code == "version"  # newer than announced
    assert check_versions(traj(version=1), floor=2, newest=3).code == "version"  # older than the task allowed
    inserted = traj(4, versions=np.array([-1, -1, 3, 3], np.int32), loss_mask=np.array([0, 0, 1, 1], np.uint8))
    assert check_versions(inserted, floor=2, newest=3) is None  # tool output before any generated token carries -1
    assert check_versions(traj(4, versions=np.array([-2, 3, 3, 3], np.int32), loss_mask=np.array([0, 1, 1, 1], np.uint8)),
                          floor=2, newest=3).code == "version"


def test_limits_come_from_the_recipe():
    single = Limits.of(parse_recipe({"name": "t", "rollout": {"max_new_tokens": 5}, "dataflow": {"group_size": 3}}))
    assert single.group_size == 3 and single.policies["solver"] == PolicyLimits(vocab=384, max_completion=5, max_generated=5, max_row=None)
    multi = Limits.of(parse_recipe({"name": "t", "workflow": {"type": "multi_turn_tools", "max_turns": 3}, "model": {"max_positions": 300},
                                    "rollout": {"max_new_tokens": 5}}))
    assert multi.policies["solver"] == PolicyLimits(vocab=384, max_completion=None, max_generated=15, max_row=300)
    agent = Limits.of(parse_recipe({"name": "t", "workflow": {"type": "openai_agent", "agent": "x:y"}, "model": {"max_positions": 300}}))
    assert agent.policies["solver"].max_generated is None and agent.policies["solver"].max_row == 300  # any number of calls, one context


# ------------------------------------------------------------ model limits without building the model
def test_model_limits_match_the_built_model(tmp_path):
    cfg = ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=48)
    model = build_model(cfg, load_tokenizer("byt5"))
    assert model_limits(cfg).vocab == model.get_input_embeddings().num_embeddings == 384 and model_limits(cfg).context == 48

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["one plus two is three", "four five six seven"] * 20,
                            trainers.BpeTrainer(vocab_size=50, special_tokens=["<unk>", "<pad>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    fast.add_tokens(["<tool>", "</tool>"])
    fast.save_pretrained(tmp_path / "tok")
    own = cfg.model_copy(update={"tokenizer": str(tmp_path / "tok")})
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert model_limits(own).vocab == len(loaded) == build_model(own, loaded).get_input_embeddings().num_embeddings

    model.save_pretrained(tmp_path / "model")
    pretrained = ModelConfig(pretrained=str(tmp_path / "model"))
    assert model_limits(pretrained).vocab == 384 and model_limits(pretrained).context == 48


# ------------------------------------------------------------ the floors tasks were issued with
def test_floors_and_recent_tasks_survive_a_restart():
    f = InFlight()
    for n in range(1, 9):
        f.issued(f"t{n:08d}", None, {"solver": n // 3, "verifier": 0})
    assert [f.floor(f"t{n:08d}", "solver") for n in range(1, 9)] == [0, 0, 1, 1, 1, 2, 2, 2]
    assert f.floor("t00000009", "solver") == 2 and f.floor("x1", "solver") == 0 and f.floor("t00000003", "critic") == 0
    assert len(f.floors.points) == 3  # change points, not one entry per task
    assert f.recent("t00000008") and f.recent("t00000001") and not f.recent("t00000009") and not f.recent("x1")
    back = InFlight()
    back.load_state(*f.state(), newest=8)
    assert back.state() == f.state() and back.floor("t00000005", "solver") == 1 and back.recent("t00000008")
    book = TaskBook("solver", primary=True)  # one policy: only the tasks still waited on are asked about
    one = InFlight(book, other_lanes=False)
    for n in range(1, 42):
        if n == 40:
            book.move("t00000007", Stage.KEPT)  # back and kept: still waited on
        if n == 41:
            book.move("t00000007", Stage.PLANNED)  # batched: no longer
        book.move(f"t{n:08d}", Stage.ISSUED)
        one.issued(f"t{n:08d}", None, {"solver": n})  # a new version every task: a change point each
        if n not in (7, 30):
            book.move(f"t{n:08d}", Stage.SETTLED)
        if n == 40:
            assert one.floors.points[0][0] == 7
    assert [p[0] for p in one.floors.points] == list(range(30, 42))  # from the oldest out or kept on
    assert one.floor("t00000030", "solver") == 30 and one.floor("t00000041", "solver") == 41
    big = Floors()
    for n in range(1, 3 * RECENT):
        big.note(n, {"solver": n})
    assert len(big.points) <= RECENT + 1 and big.at(3 * RECENT - 1) == {"solver": 3 * RECENT - 1}


def test_a_fate_is_a_typed_value_written_kind_colon_reason():
    assert [str(f) for f in (TRAINED, DROPPED_STALE, Fate.invalid("logprob"))] == ["trained", "dropped:stale", "invalid:logprob"]
    for text in ("trained", "dropped:stale", "filtered:greso_3", "failed:max_deliver"):
        assert str(Fate.parse(text)) == text
    assert Fate.parse("invalid:token").outcome is Outcome.INVALID and not Outcome.INVALID.completes_a_group
    assert Outcome.FILTERED.completes_a_group and not Outcome.FAILED.completes_a_group
    for bad in ("batched", "lost:x", "trained:x", "failed", "failed:", ""):
        with pytest.raises(ValueError, match="not a fate"):
            Fate.parse(bad)


def test_secondary_lanes_count_invalid_groups_like_failed_ones():
    led = Ledger(received=3)
    led.record(Fate.parse("trained"), 2)
    led.record(Fate.parse("invalid:reward"))
    led.record(Fate.parse("failed:rollout"))
    assert account(led, primary=False, in_flight=0, buffered=1, awaiting=0).adds_up
    primary = Ledger(issued=5)
    primary.record(Fate.parse("invalid:token"), 2)
    assert account(primary, primary=True, in_flight=1, buffered=1, awaiting=1).adds_up


# ------------------------------------------------------------ batches: the manifest's digest and the trainer's checks
def batch(n: int = 4, adv: float = 0.5, version: int = 3) -> TrainingBatch:
    trajs = [traj(task=f"t0000000{i // 2 + 1}", index=i % 2, version=version) for i in range(n)]
    refs = [TrajRef(seq=100 + i, traj_id=t.traj_id, task_id=t.task_id) for i, t in enumerate(trajs)]
    manifest = Batch(batch_id="solver-b000001", policy="solver", refs=refs, advantages=np.full(n, adv, np.float32),
                     task_ids=sorted({t.task_id for t in trajs}))
    return TrainingBatch(manifest, trajs)


def with_ref(b: Batch, i: int, **ref: object) -> Batch:
    refs = list(b.refs)
    refs[i] = refs[i].model_copy(update=ref)
    return b.model_copy(update={"refs": refs})


FIELDS = {  # a change to anything trained must change the manifest's digest
    "advantages": lambda b: b.model_copy(update={"advantages": np.full(4, 0.25, np.float32).tobytes()}),
    "task_ids": lambda b: b.model_copy(update={"task_ids": ["t00000009"]}),
    "batch_id": lambda b: b.model_copy(update={"batch_id": "solver-b000002"}),
    "policy": lambda b: b.model_copy(update={"policy": "verifier"}),
    "seq": lambda b: with_ref(b, 0, seq=99),
    "traj_id": lambda b: with_ref(b, 1, traj_id="t00000001.solver.7"),
    "ref_task_id": lambda b: with_ref(b, 2, task_id="t00000009"),
    "order": lambda b: b.model_copy(update={"refs": b.refs[::-1]}),
    "one_less": lambda b: b.model_copy(update={"refs": b.refs[:3], "advantages": np.full(3, 0.5, np.float32).tobytes()}),
}


@pytest.mark.parametrize("field", FIELDS)
def test_the_manifest_digest_covers_what_is_trained(field: str):
    b = batch().manifest
    assert decode(encode(b), Batch).digest() == b.digest()  # the wire does not change it
    assert FIELDS[field](b).digest() != b.digest()


def test_a_manifest_stays_small_however_long_its_trajectories():
    refs = [TrajRef(seq=10**9 + i, traj_id=f"t{i // 8:08d}.solver.{i % 8}", task_id=f"t{i // 8:08d}") for i in range(512)]
    manifest = Batch(batch_id="solver-b000001", policy="solver", refs=refs, advantages=np.zeros(512, np.float32),
                     task_ids=[f"t{g:08d}" for g in range(64)])
    assert len(encode(manifest)) < 64 * 1024  # 64 groups x 8 samples, of any length: far under max_payload


def test_the_trainer_turns_away_what_it_cannot_train():
    b = batch()
    assert check_manifest(b.manifest, "solver") is None and check_batch(b, VOCAB, version=5, max_lag=2) is None
    assert check_manifest(b.manifest, "verifier").reason.startswith("invalid: a batch of 'solver'")
    assert check_manifest(batch(adv=math.nan).manifest, "solver").reason.startswith("invalid: 4 non-finite advantages")
    short = b.manifest.model_copy(update={"advantages": np.zeros(3, np.float32).tobytes()})
    assert check_manifest(short, "solver").reason.startswith("invalid: 3 advantages for 4")
    assert check_batch(b, vocab=12, version=5, max_lag=2).reason.startswith("invalid: t00000001.solver.0 has token ids")
    assert check_batch(batch(version=2), VOCAB, version=5, max_lag=2).reason.startswith("stale: oldest token v2, trainer at v5")


def test_the_trajectory_with_a_token_outside_the_vocabulary_is_named():
    """The batch's token ids are checked in one pass; when one is out of range the first trajectory holding one is
    named, wherever it is in the batch."""
    b = batch()
    bad = b.trajectories[2].model_copy(update={"completion_ids": np.array([1, VOCAB + 5], "<i4").tobytes()})
    refused = check_batch(TrainingBatch(b.manifest, [*b.trajectories[:2], bad, *b.trajectories[3:]]), VOCAB, version=5, max_lag=2)
    assert refused is not None and refused.reason.startswith(f"invalid: {bad.traj_id} has token ids in [1, {VOCAB + 5}]")
    negative = b.trajectories[3].model_copy(update={"prompt_ids": np.array([-1], "<i4").tobytes()})
    refused = check_batch(TrainingBatch(b.manifest, [*b.trajectories[:3], negative]), VOCAB, version=5, max_lag=2)
    assert refused is not None and refused.reason.startswith(f"invalid: {negative.traj_id} has token ids in [-1, ")


@pytest.mark.parametrize("other", [{"traj_id": "t00000001.solver.3", "index": 3}, {"task_id": "t00000009", "traj_id": "t00000009.solver.0"},
                                   {"policy": "verifier", "traj_id": "t00000001.verifier.0"}])
def test_a_fetched_trajectory_must_be_the_one_its_reference_names(other: dict[str, object]):
    b = batch()
    swapped = TrainingBatch(b.manifest, [b.trajectories[0].model_copy(update=other), *b.trajectories[1:]])
    assert check_batch(swapped, VOCAB, version=5, max_lag=2).reason.startswith("mismatch: sequence 100 holds")


def test_non_finite_weights_are_named():
    state = {"a": torch.zeros(3), "b": torch.tensor([1.0, math.nan]), "c": torch.tensor([math.inf]), "steps": torch.tensor([3])}
    assert non_finite(state) == ["b", "c"] and non_finite({"a": torch.ones(2, dtype=torch.bfloat16)}) == []


def test_an_image_in_one_buffer_is_checked_whole_and_its_bad_tensors_named():
    """The trainer's image (``to_bf16_state``: one buffer) is cleared by one sum; a NaN or an infinity in it is still named,
    and finite values whose float32 sum overflows are no false alarm."""
    image = to_bf16_state({"a": torch.ones(3), "b": torch.zeros(5), "c": torch.ones(2)})
    assert non_finite(image) == []
    image["b"][2] = math.nan
    image["c"][0] = math.inf
    assert non_finite(image) == ["b", "c"]
    assert non_finite(to_bf16_state({"x": torch.full((4096,), 3e38), "y": torch.ones(2)})) == []


def test_a_state_found_finite_is_passed_on_as_such():
    """``checked`` hands a finite state on as a ``FiniteState`` (the publisher stores it without a second check), and a
    state with a NaN as nothing but the names of its bad tensors."""
    good, bad = checked({"a": torch.ones(2, dtype=torch.bfloat16), "steps": torch.tensor([3])})
    assert isinstance(good, FiniteState) and bad == [] and set(good) == {"a", "steps"}
    poisoned, bad = checked({"a": torch.ones(2), "b": torch.tensor([1.0, math.nan])})
    assert poisoned is None and bad == ["b"]


def test_non_finite_is_exact_at_the_edges_of_each_dtype():
    """Found from a float64 sum: no false alarm where a float32 sum would overflow, none for float64 values whose
    own sum overflows, and every NaN or infinity found, also an infinity beside one of the other sign."""
    big = {dt: torch.full((4096,), torch.finfo(dt).max, dtype=dt) for dt in (torch.bfloat16, torch.float16, torch.float32)}
    assert non_finite({**{str(dt): t for dt, t in big.items()}, "f64": torch.tensor([1e308, 1e308], dtype=torch.float64),
                       "empty": torch.zeros(0)}) == []
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for values in ([math.inf, -math.inf], [math.nan, 1.0], [-math.inf], [0.0, math.inf]):
            t = torch.zeros(1000, dtype=dt)
            t[500:500 + len(values)] = torch.tensor(values, dtype=dt)
            assert non_finite({"ok": torch.ones(3, dtype=dt), "bad": t}) == ["bad"], (dt, values)


# ------------------------------------------------------------ announcements (the node side)
def sha(x: str) -> str:
    return hashlib.sha256(x.encode()).hexdigest()


def ann(version: int = 3, encoding: str = "delta", base: int | None = 2, keyframe: int = 0, size: int = 10, chunk: int = 4,
        chunks: int = 3, policy: str = "solver", digest: str | None = None) -> WeightVersion:
    ref = ObjectRef(name=f"solver/v{version}", nuid="Abc123", size=size, chunk_size=chunk, digests=[sha(str(i)) for i in range(chunks)],
                    digest=sha("whole"))
    return WeightVersion(policy=policy, version=version, encoding=encoding, base_version=base,
                         base_digest=sha("base") if base is not None else None, state_digest=digest or sha(f"v{version}"),
                         keyframe_version=keyframe, objects=[ref])


def test_impossible_announcements_are_named():
    assert announcement_problem(ann(), "solver") is None
    assert announcement_problem(ann(encoding="keyframe", base=None, keyframe=3), "solver") is None
    bad = {
        "of policy 'critic'": ann(policy="critic"),
        "applies onto v3, not an earlier": ann(base=3),
        "applies onto v5": ann(base=5),
        "names keyframe_version 4": ann(keyframe=4),
        "keyframe v3 names a base": ann(encoding="keyframe", base=2, keyframe=3),
        "keyframe v3 names keyframe_version 1": ann(encoding="keyframe", base=None, keyframe=1),
        "2 chunk digests for 10 bytes": ann(chunks=2),
        "chunk size 0": ann(chunk=0),
        "state_digest is not a sha256": ann(digest="x"),
        "version -1 < 0": ann(version=-1, base=None, encoding="keyframe", keyframe=-1),
        "delta v3 without a base": ann(base=None),
    }
    for expected, a in bad.items():
        problem = announcement_problem(a, "solver")
        assert problem is not None and expected in problem, (expected, problem)
    two = ann().model_copy(update={"objects": ann().objects * 2})
    assert "names 2 objects" in announcement_problem(two, "solver")
    star = ann().model_copy(update={"objects": [ann().objects[0].model_copy(update={"nuid": ">"})]})
    assert "not a subject token" in announcement_problem(star, "solver")


def test_announced_versions_only_rise():
    v3 = ann()
    assert order_problem(v3, None) is None and order_problem(ann(version=4, base=3), v3) is None
    assert order_problem(v3, v3) is None  # the same announcement again: ignored, not an offence
    assert "announced again with another state" in order_problem(ann(digest=sha("other")), v3)
    assert "announced after v3" in order_problem(ann(version=2, base=1), v3)


def test_schemas_document_the_traj_id_convention(repo_root):
    schema = json.loads((repo_root / "schemas" / "trajectory.json").read_text())
    assert "{task_id}.{policy}.{index}" in schema["properties"]["traj_id"]["description"]
