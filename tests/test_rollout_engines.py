"""Engines: hf details, and the sglang / vllm clients against FAKE servers.

The FAKE servers below are NOT SGLang or vLLM. They are small stdlib HTTP servers that speak
the documented request/response shapes of SGLang's native API (``/generate``,
``/update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``,
``/flush_cache``) and of vLLM's OpenAI-compatible server plus its dev-mode RL endpoints
(``/v1/completions``, ``/pause``, ``/resume``, ``/collective_rpc``, ``/reset_prefix_cache``),
so these tests check our request building, response parsing, pause/update ordering and
version tagging — not the real engines (see docs/rollout.md for what was verified).
"""

from __future__ import annotations

import functools
import json
import os
import random
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from safetensors.torch import load_file

from astraflow.config import ModelConfig, RolloutConfig
from astraflow.models import build_model, load_tokenizer
from astraflow.rollout.engines import remote
from astraflow.rollout.engines import sglang as sglang_engine
from astraflow.rollout.engines import vllm as vllm_engine
from astraflow.rollout.engines.base import GenerationRequest, SamplingParams
from astraflow.rollout.engines.hf import HFEngine, stop_at
from astraflow.rollout.engines.registry import build_engine
from astraflow.rollout.engines.remote import EngineHTTPError
from astraflow.rollout.http_json import JsonHandler

TOK = load_tokenizer("byt5")
TINY = ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)


class FakeServer(ThreadingHTTPServer):
    """FAKE engine server: records every request, generates deterministic tokens, 'loads' staged weights."""

    daemon_threads = True

    def __init__(self, flavour: str) -> None:
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        self.flavour = flavour
        self.log: list[str] = []
        self.bodies: list[tuple[str, Any]] = []
        self.version = "0"
        self.loaded: dict[str, torch.Tensor] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.arrived = threading.Event()
        self.abort = False
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def tokens(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        return [(prompt[-1] + k) % 200 + 3 for k in range(1, n + 1)], [-0.1 * k for k in range(1, n + 1)]


class _FakeHandler(JsonHandler):
    server: FakeServer

    def do_GET(self) -> None:  # noqa: N802
        path = urlparse(self.path).path
        if path == "/health":
            return self._reply(200, {})
        if path == "/v1/models" and self.server.flavour == "vllm":
            return self._reply(200, {"object": "list", "data": [{"id": "served-policy"}]})
        self._reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        s = self.server
        path = urlparse(self.path).path
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        s.bodies.append((self.path, body))
        s.log.append(path)
        if s.flavour == "sglang":
            return self._sglang(path, body)
        return self._vllm(path, body)

    def _load(self, path: str) -> None:
        s = self.server
        assert os.path.exists(f"{path}/config.json"), "the staged version is not a loadable model directory"
        s.loaded = load_file(f"{path}/model.safetensors")

    def _sglang(self, path: str, body: dict) -> None:
        s = self.server
        if path == "/generate":
            s.arrived.set()
            s.gate.wait()
            sp = body["sampling_params"]
            out = []
            for prompt in body["input_ids"]:
                ids, lps = s.tokens(prompt, sp["max_new_tokens"])
                reason = {"type": "abort", "message": "paused"} if s.abort else {"type": "length", "length": len(ids)}
                out.append({"text": "x", "meta_info": {"id": "r", "finish_reason": reason, "weight_version": s.version,
                                                        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}})
            s.log.append("/generate:done")
            return self._reply(200, out if isinstance(body["input_ids"][0], list) else out[0])
        if path == "/update_weights_from_disk":
            self._load(body["model_path"])
            s.version = body.get("weight_version", s.version)
            return self._reply(200, {"success": True, "message": "ok", "num_paused_requests": 0})
        if path in ("/pause_generation", "/continue_generation", "/flush_cache"):
            return self._reply(200, {"status": "ok"})
        self._reply(404, {"detail": "Not Found"})

    def _vllm(self, path: str, body: dict) -> None:
        s = self.server
        if path == "/v1/completions":
            assert body["model"] == "served-policy" and body["return_tokens_as_token_ids"] is True and body["logprobs"] == 1
            choices = []
            for i, prompt in enumerate(body["prompt"]):
                ids, lps = s.tokens(prompt, body["max_tokens"])
                choices.append({"index": i, "text": "x", "finish_reason": "length",
                                "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": lps}})
            random.Random(0).shuffle(choices)  # the server may answer in any order; index says which
            return self._reply(200, {"id": "cmpl", "object": "text_completion", "choices": choices})
        if path == "/collective_rpc":
            assert body["method"] == "astraflow_load_weights"
            self._load(body["args"][0])
            return self._reply(200, {"results": [len(s.loaded)]})
        if path in ("/pause", "/resume", "/reset_prefix_cache"):
            return self._reply(200, {"status": "ok"})
        self._reply(404, {"detail": "Not Found"})


@pytest.fixture
def fake_sglang():
    s = FakeServer("sglang")
    yield s
    s.shutdown()


@pytest.fixture
def fake_vllm():
    s = FakeServer("vllm")
    yield s
    s.shutdown()


def tiny_state() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_model(TINY.model_copy(update={"seed": 3}), TOK).state_dict().items()}


def test_stop_strings_cut_where_the_stop_string_completes():
    ids = TOK("ab</tool>cd", add_special_tokens=False)["input_ids"]
    assert TOK.decode(ids[: stop_at(TOK, ids, ("</tool>",))]) == "ab</tool>"
    assert stop_at(TOK, ids, ("zz",)) is None


def test_hf_engine_versions_logprobs_and_seeds():
    engine = HFEngine(build_model(TINY, TOK), TOK)
    engine.load_state(tiny_state(), 4)
    params = SamplingParams(max_new_tokens=5, seed=11)
    a = engine.generate([GenerationRequest([10, 11, 12], params), GenerationRequest([13], params)])
    b = engine.generate([GenerationRequest([10, 11, 12], params), GenerationRequest([13], params)])
    assert [c.token_ids for c in a] == [c.token_ids for c in b]  # seeded: reproducible
    for c in a:
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) and set(c.versions) == {4}
        assert all(lp <= 0 for lp in c.logprobs)


@pytest.mark.parametrize("window", [None, 4])
def test_hf_engine_reads_a_groups_prompt_once_and_samples_as_the_plain_path(monkeypatch, window: int | None):
    """Groups of samples of prompts of different lengths (left padding), and two prompts alike but for their last token:
    the cache of the distinct prefixes is computed once and repeated, and the seeded samples and their logprobs are
    those of ``generate`` reading every row itself (plain attention and ``attention_window``)."""
    from astraflow.rollout.engines import hf
    from astraflow.rollout.engines.shared_prefill import shared_prefill

    cfg = TINY.model_copy(update={"num_layers": 2, "attention_window": window, "seed": 3})
    engine = HFEngine(build_model(cfg, TOK), TOK)
    params = SamplingParams(max_new_tokens=6, seed=5)
    prompts = [[10, 11, 12, 13, 14], [20, 21], [30, 31, 32], [40, 41, 42, 43, 44], [40, 41, 42, 43, 45]]
    requests = [GenerationRequest(p, params) for p in prompts for _ in range(4)]
    reads: list[int] = []
    widths: list[int] = []  # of each input the model's forward took: generate's first is the prompt, or its last token
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward",  # wraps: generate reads the forward's signature
                        functools.wraps(forward)(lambda *a, **kw: widths.append(kw["input_ids"].shape[1]) or forward(*a, **kw)))
    monkeypatch.setattr(hf, "shared_prefill", lambda m, ids, att: reads.append(len(c := shared_prefill(m, ids, att))) or c)
    shared = engine.generate(requests)
    shared_first, widths[:] = widths[0], []
    monkeypatch.setattr(hf, "shared_prefill", lambda m, ids, att: {})
    plain = engine.generate(requests)
    assert reads == [1]  # the cache was shared
    assert (shared_first, widths[0]) == (1, 5)  # generate read each row's last token alone, not the 5-token prompts
    assert [c.token_ids for c in shared] == [c.token_ids for c in plain]
    for a, b in zip(shared, plain, strict=True):
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0.0) < 1e-4


def test_hf_engine_batches_concurrent_calls_together():
    """Calls from several generation slots that wait while the engine is busy share its next batch, and each gets
    exactly its own completions (greedy: the same tokens as generating it alone)."""
    engine = HFEngine(build_model(TINY, TOK), TOK)
    engine.load_state(tiny_state(), 2)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    prompts = [[[10, 11, 12]], [[13], [14, 15]], [[16, 17]]]
    alone = [[c.token_ids for c in engine.generate([GenerationRequest(p, greedy) for p in ps])] for ps in prompts]
    batches: list[int] = []
    inner = engine._generate
    engine._generate = lambda reqs: batches.append(len(reqs)) or inner(reqs)  # type: ignore[method-assign]
    results: dict[int, list[list[int]]] = {}

    def call(k: int) -> None:
        results[k] = [c.token_ids for c in engine.generate([GenerationRequest(p, greedy) for p in prompts[k]])]

    with engine._held():  # the engine is busy: all three calls queue for its next batch
        threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(engine._waiting) < 3:
            assert time.monotonic() < deadline, "calls did not queue"
            time.sleep(0.01)
    for t in threads:
        t.join(30)
    assert batches == [4]  # one batch of all four requests
    assert [results[k] for k in range(3)] == alone


def test_hf_engine_waits_a_little_for_the_callers_of_its_slots():
    """A node's slots come back some ms apart after a batch: the engine, told how many there are, waits for the late
    one instead of starting the first alone (which would split every later batch in two); a caller that never comes
    costs one bounded wait."""
    engine = HFEngine(build_model(TINY, TOK), TOK)
    engine.load_state(tiny_state(), 1)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    engine.generate([GenerationRequest([10, 11], greedy)])  # a first batch: its time sets the wait
    engine.gather = 2.0 / engine._batch_s  # a wait of up to 2 s, whatever this machine's speed
    batches: list[int] = []
    inner = engine._generate
    engine._generate = lambda reqs: batches.append(len(reqs)) or inner(reqs)  # type: ignore[method-assign]
    engine.expect_callers(2)
    first = threading.Thread(target=engine.generate, args=([GenerationRequest([12], greedy)],))
    first.start()
    time.sleep(0.15)  # the second slot comes back later, as a re-admitted task does
    engine.generate([GenerationRequest([13, 14], greedy), GenerationRequest([15], greedy)])
    first.join(30)
    assert batches == [3]  # one batch: the first caller waited for the second
    t0 = time.monotonic()
    engine.generate([GenerationRequest([16], greedy)])  # the other slot never comes: bounded by the wait
    assert batches == [3, 1] and time.monotonic() - t0 < 30
    engine.expect_callers(1)  # one caller (the evaluator): never a wait
    cap, t0 = engine.gather * engine._batch_s, time.monotonic()
    engine.generate([GenerationRequest([17], greedy)])
    assert batches == [3, 1, 1] and time.monotonic() - t0 < cap / 4


def test_sglang_client_generates_and_updates_with_pause(fake_sglang, tmp_path):
    cfg = RolloutConfig(engine={"type": "sglang", "url": fake_sglang.url, "weight_staging_dir": str(tmp_path)})
    engine = build_engine(TINY, cfg, TOK)
    try:
        state = tiny_state()
        engine.load_state(state, 1)
        assert fake_sglang.log == ["/pause_generation", "/update_weights_from_disk", "/flush_cache", "/continue_generation"]
        assert dict(fake_sglang.bodies)["/pause_generation"] == {"mode": "retract"}
        assert dict(fake_sglang.bodies)["/update_weights_from_disk"]["weight_version"] == "1"
        assert fake_sglang.loaded.keys() == state.keys()
        assert all(torch.equal(fake_sglang.loaded[k], v.to(torch.bfloat16)) for k, v in state.items())  # staged as bf16
        first_dir = engine.stager.current
        params = SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, stop=("\n",), seed=5)
        comps = engine.generate([GenerationRequest([5, 6], params), GenerationRequest([9], params)])
        assert [c.token_ids for c in comps] == [[10, 11, 12], [13, 14, 15]] and all(c.versions == [1, 1, 1] for c in comps)
        assert comps[0].logprobs == pytest.approx([-0.1, -0.2, -0.3]) and comps[0].finish_reason == "length"
        sent = dict(fake_sglang.bodies)["/generate"]
        assert sent["return_logprob"] is True and sent["input_ids"] == [[5, 6], [9]]
        assert sent["sampling_params"] == {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "no_stop_trim": True,
                                           "skip_special_tokens": False, "stop": ["\n"], "sampling_seed": 5}
        engine.load_state(state, 2)
        assert engine.version == 2 and not first_dir.exists() and engine.stager.current.exists()  # old version removed after the new loaded
        fake_sglang.abort = True
        with pytest.raises(sglang_engine.EngineAborted):
            engine.generate([GenerationRequest([1], params)])
    finally:
        engine.close()
    assert not engine.stager.root.exists()


def test_sglang_update_waits_for_generation_in_flight(fake_sglang, tmp_path):
    cfg = RolloutConfig(engine={"type": "sglang", "url": fake_sglang.url, "weight_staging_dir": str(tmp_path)})
    engine = build_engine(TINY, cfg, TOK)
    try:
        fake_sglang.gate.clear()
        gen = threading.Thread(target=engine.generate, args=([GenerationRequest([1], SamplingParams(max_new_tokens=2))],))
        gen.start()
        assert fake_sglang.arrived.wait(30)
        upd = threading.Thread(target=engine.load_state, args=(tiny_state(), 7))
        upd.start()
        while engine.lock.waiting_writers == 0:  # the update is queued behind the generation
            upd.join(0.01)
        assert "/pause_generation" not in fake_sglang.log
        fake_sglang.gate.set()
        gen.join(30)
        upd.join(30)
        assert fake_sglang.log.index("/generate:done") < fake_sglang.log.index("/pause_generation")
        assert engine.version == 7
    finally:
        fake_sglang.gate.set()
        engine.close()


def test_vllm_client_generates_in_order_and_updates_through_collective_rpc(fake_vllm, tmp_path):
    cfg = RolloutConfig(engine={"type": "vllm", "url": fake_vllm.url, "weight_staging_dir": str(tmp_path)})
    engine = build_engine(TINY, cfg, TOK)
    try:
        assert engine.model == "served-policy"
        engine.load_state(tiny_state(), 3)
        assert fake_vllm.log == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]
        assert dict(fake_vllm.bodies)["/pause?mode=wait"] == {}
        prompts = [[1], [2], [3], [4], [5]]
        comps = engine.generate([GenerationRequest(p, SamplingParams(max_new_tokens=2, stop=("x",))) for p in prompts])
        assert [c.token_ids for c in comps] == [[p[0] + 4, p[0] + 5] for p in prompts]  # matched by index, not reply order
        assert all(c.versions == [3, 3] for c in comps)
        sent = dict(fake_vllm.bodies)["/v1/completions"]
        assert sent["prompt"] == prompts and sent["stop"] == ["x"] and sent["include_stop_str_in_output"] is True
    finally:
        engine.close()


def test_vllm_reply_without_token_ids_is_an_error():
    with pytest.raises(EngineHTTPError, match="token_id"):
        vllm_engine.parse_choice({"index": 0, "logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}}, 0)


def test_launch_commands():
    sg = sglang_engine.launch_command("/m", 3000, ["--tp", "2"])
    assert sg[1:] == ["-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1", "--port", "3000", "--tp", "2"]
    vl = vllm_engine.launch_command("/m", 8000, [])
    assert vl[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert vl[vl.index("--worker-extension-cls") + 1] == "astraflow.rollout.engines.vllm.WeightLoaderExtension"
    assert vl[vl.index("--logprobs-mode") + 1] == "processed_logprobs"


def test_a_tiny_model_is_saved_once_under_a_path_named_by_its_files(tmp_path, monkeypatch):
    """Servers load a recipe's tiny model from one path per content, so their compile caches (keyed by the path) serve
    every later start; a copy whose files changed there is replaced, never loaded."""
    monkeypatch.setattr(remote.tempfile, "tempdir", str(tmp_path))
    tok = load_tokenizer("byt5")
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    first = remote.model_dir(cfg, tok, tmp_path / "a" / "initial")
    again = remote.model_dir(cfg, tok, tmp_path / "b" / "initial")
    assert first == again and Path(first).name.startswith("astraflow-model-")
    assert not (tmp_path / "a" / "initial").exists() and not (tmp_path / "b" / "initial").exists()
    digest = remote.files_digest(Path(first))
    other = remote.model_dir(cfg.model_copy(update={"seed": cfg.seed + 1}), tok, tmp_path / "c" / "initial")
    assert other != first  # other weights, another path
    (Path(first) / "config.json").write_text("{}")  # changed in place: the next start puts the saved files back
    assert remote.model_dir(cfg, tok, tmp_path / "d" / "initial") == first and remote.files_digest(Path(first)) == digest
    Path(other).rename(tmp_path / "moved")
    Path(other).write_text("not a folder")  # a path it cannot take: the private copy is loaded instead
    private = tmp_path / "e" / "initial"
    assert remote.model_dir(cfg.model_copy(update={"seed": cfg.seed + 1}), tok, private) == str(private) and private.is_dir()


def test_vllm_worker_extension_loads_staged_weights(tmp_path):
    from astraflow.rollout.engines.remote import WeightStager

    model = build_model(TINY, TOK)
    stager = WeightStager(str(tmp_path), tmp_path)
    path = stager.stage(tiny_state(), 1)

    class Runner:  # what vLLM's worker exposes: model_runner.model.load_weights(iterable of (name, tensor))
        def __init__(self) -> None:
            self.model = self
            self.got: dict[str, torch.Tensor] = {}

        def load_weights(self, weights: list) -> None:
            self.got = dict(weights)

    ext = vllm_engine.WeightLoaderExtension()
    ext.model_runner = Runner()
    assert ext.astraflow_load_weights(str(path)) == len(model.state_dict())
    assert ext.model_runner.got.keys() == model.state_dict().keys()
