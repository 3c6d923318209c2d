"""Weight versions an engine's own worker fetches (vLLM's path: ``rollout/engines/worker_weights.py``), on a real
nats-server: the node plans and holds no image; the worker reads each payload from the object store over a connection
of its own, checks and stages it while the engine serves; the engine's parameters change only at the install, which
writes only what the version changed; a corrupt chunk is never installed (the node plans again from the keyframe chain
and keeps the last verified version).

The worker here is ``WorkerWeights`` itself, run in this process and installing into an hf model; the part that is
vLLM's own (its layerwise reload, repacking the CPU kernels' weights) is checked against a real vLLM by
``tests/test_vllm_cpu.py`` (``examples/engine_check.py --plane``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from test_weights_plane import rewrite_chunks
from weights_helpers import Trainer, engine_digest, tiny_model

from astraflow.rollout.engines.hf import HFEngine
from astraflow.rollout.engines.worker_weights import WorkerWeights, whole_layers
from astraflow.streams.messages import WeightVersion
from astraflow.streams.object_source import ObjectSource
from astraflow.streams.plane import Plane
from astraflow.weights.engine_held import EngineHeldImage, FetchReport
from astraflow.weights.publish import WeightPublisher
from astraflow.weights.sync import WeightSync


class WorkerFetchingEngine(HFEngine):
    """An hf engine that takes its weights the way vLLM's worker does: ``WorkerWeights`` fetches, the install writes."""

    def __init__(self) -> None:
        super().__init__(tiny_model(123), tokenizer=None)
        self.worker = WorkerWeights("test-worker")
        self.installs: list[set[str]] = []  # the names each install wrote
        self.digest_at_fetch: list[str] = []  # the engine's own weights when each fetch was done

    def fetch_chain(self, source: ObjectSource, chain: list[WeightVersion]) -> FetchReport:
        job = self.worker.begin(source, chain)
        while (report := self.worker.poll(job)) is None:
            time.sleep(0.002)
        self.digest_at_fetch.append(engine_digest_of(self))
        return report

    def install_fetched(self, version: int) -> None:
        taken = self.worker.take()
        assert taken is not None and taken[0] == version
        _, names, image = taken
        self.load_state({**self.state_view(), **{n: image[n] for n in names}}, version)
        self.installs.append(names)


def engine_digest_of(engine: HFEngine) -> str:
    from astraflow.weights.delta import state_digest, to_bf16_state

    return state_digest(to_bf16_state(engine.state_view()))


@pytest.fixture
def engine() -> Iterator[WorkerFetchingEngine]:
    e = WorkerFetchingEngine()
    yield e
    e.worker.close()


async def test_the_worker_fetches_checks_and_stages_versions_and_the_install_writes_only_what_changed(plane: Plane, engine):
    only = "model.layers.0.mlp.down_proj.weight"
    trainer = Trainer(lr=1e-3, only=only)
    pub = WeightPublisher(plane, "solver", keyframe_every=100)
    sync = WeightSync(plane, "solver", engine)
    assert isinstance(sync.held, EngineHeldImage)  # the node holds no image of its own
    start = engine_digest_of(engine)
    await pub.publish(trainer.model.state_dict(), 0)
    await sync.wait_for(0, timeout=20)
    assert engine.digest_at_fetch == [start]  # fetched and checked without touching the engine's weights
    assert engine_digest(sync) == trainer.digest and engine.installs[0] == set(trainer.model.state_dict())
    for v in (1, 2):
        ann = await pub.publish(trainer.step(), v)
        assert ann.encoding == "delta"
        await sync.wait_for(v, timeout=20)
        assert engine_digest(sync) == trainer.digest == sync.held.digest
    assert engine.installs[1:] == [{only}, {only}]  # a delta writes only the tensors it changed
    assert sync.stats["keyframes"] == 1 and sync.stats["deltas"] == 2 and sync.stats["bytes"] > 0


async def test_a_corrupt_chunk_is_never_installed_and_a_keyframe_brings_the_worker_back(plane: Plane, engine):
    trainer = Trainer(lr=1e-3)
    pub = WeightPublisher(plane, "solver", keyframe_every=100, max_delta_fraction=1.0)
    sync = WeightSync(plane, "solver", engine)
    for v in range(2):
        await pub.publish(trainer.step() if v else trainer.model.state_dict(), v)
    await sync.wait_for(1, timeout=20)
    good = engine_digest(sync)
    ann = await pub.publish(trainer.step(), 2)
    await rewrite_chunks(plane, ann.objects[0], corrupt=0)
    assert not await sync.refresh(wait=2.0)
    assert sync.version == 1 and engine_digest(sync) == good  # the engine kept its last verified version
    assert sync.stats["corrupt"] >= 2 and sync.stats["fallbacks"] == 1 and sync.stats["failures"] == 1
    assert "the engine's worker" in sync.last_error and "v2" in sync.last_error
    ann = await pub.publish(trainer.step(), 3, force_keyframe=True)
    assert await sync.refresh(wait=2.0)
    assert sync.version == 3 and engine_digest(sync) == trainer.digest


def test_a_change_to_one_part_of_a_fused_layer_rewrites_the_whole_layer():
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
             "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
             "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # vLLM's Qwen2
    assert whole_layers({"model.layers.0.self_attn.k_proj.weight"}, names, packed) == [
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight"]
    assert whole_layers({"model.layers.0.mlp.up_proj.weight", "model.norm.weight"}, names, packed) == [
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]  # not layer 1's
    assert whole_layers({"model.layers.0.self_attn.o_proj.weight"}, names, {}) == ["model.layers.0.self_attn.o_proj.weight"]
