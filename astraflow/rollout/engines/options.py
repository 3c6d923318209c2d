"""Options of the built-in engines: what ``rollout.engine`` may hold, one model per engine.

Light on purpose (pydantic only): every role validates a recipe against these before any engine
is built (``astraflow.registry.ENGINES`` imports this module). A field another engine
owns fails at load (``latency_sigma`` on ``hf``).

    engine: hf
    engine: {type: sglang, url: "http://127.0.0.1:30000"}
    engine: {type: vllm, mode: inprocess}
    engine: {type: scripted, latency: pareto, latency_median_s: 0.5, latency_alpha: 1.2, concurrency: 8}
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from astraflow.registry import ENGINES, Options


def changed(options: Options, names: set[str]) -> list[str]:
    """Of ``names``, the fields set to something other than their default (a resolved recipe spells out defaults)."""
    fields = type(options).model_fields
    return sorted(n for n in names & options.model_fields_set if getattr(options, n) != fields[n].default)


@ENGINES.declare
class HfOptions(Options):
    """transformers in-process, batched, on cuda when available (``hf.py``)."""

    type: Literal["hf"] = "hf"
    switches_inside_generation: ClassVar[bool] = True  # ``rollout.partial_rollouts`` applies
    serves_adapters: ClassVar[bool] = True  # LoRA versions announced as adapters, merged into a copy (weights/adapters.py)
    gather: float = Field(0.5, ge=0)
    """Once the engine is free, how long a batch short of the node's generation slots waits for the rest of their
    calls, as a fraction of the last batch's time (0: start with whoever is waiting)."""
    dtype: Literal["model", "float32", "bfloat16", "float16"] = "model"
    """Compute dtype of the engine's model: ``model`` (``model.dtype``, what the trainer computes in), or another, as a
    GPU engine computes in bf16 while the trainer keeps fp32 weights (weights arrive as bf16 either way)."""


@ENGINES.declare
class ScriptedOptions(Options):
    """A BENCHMARK ENGINE: real tokens from the recipe's tiny model, latency drawn from a distribution (``scripted.py``)."""

    type: Literal["scripted"] = "scripted"
    serves_adapters: ClassVar[bool] = True  # its tokens come from an hf engine, which merges them
    concurrency: int = Field(8, ge=1)
    """Requests a node serves at once (their latencies overlap up to this many)."""
    latency: Literal["lognormal", "pareto", "constant"] = "lognormal"
    """Distribution of each request's latency."""
    latency_median_s: float = Field(0.5, ge=0)
    """Median request latency in seconds (the value itself for ``constant``)."""
    latency_sigma: float = Field(1.0, ge=0)
    """lognormal: standard deviation of the log latency (1.0: a long tail)."""
    latency_alpha: float = Field(1.5, gt=0)
    """pareto: tail index (smaller = heavier tail; the mean is infinite at or below 1)."""
    latency_seed: int = 0
    """Seed of the latency draws (mixed with the process id, so nodes draw independent streams)."""

    @model_validator(mode="after")
    def _shape_fits(self) -> ScriptedOptions:
        for name, dist in (("latency_sigma", "lognormal"), ("latency_alpha", "pareto")):
            if changed(self, {name}) and self.latency != dist:
                raise ValueError(f"{name} applies to latency: {dist} only (latency is {self.latency}); drop it")
        return self


class ServerOptions(Options):
    """What the server-backed engines share (``remote.py``)."""

    url: str | None = None
    """URL of a running server to attach to (``http://host:port``); None launches one on the node."""
    args: list[str] = []
    """Extra command-line arguments of a launched server (``["--tp", "2"]``)."""
    startup_timeout: float = Field(600.0, gt=0)
    """Seconds to wait for a launched server to report healthy."""
    weight_staging_dir: str | None = None
    """Where a node writes each weight version for the server to load (default: a temp dir under /dev/shm when
    it exists). The server must see the same path (same host)."""


@ENGINES.declare
class SglangOptions(ServerOptions):
    """An SGLang server, launched by the node or attached (``sglang.py``)."""

    type: Literal["sglang"] = "sglang"


@ENGINES.declare
class VllmOptions(ServerOptions):
    """vLLM's OpenAI-compatible server (launched or attached) or ``vllm.LLM`` inside the node (``vllm.py``)."""

    type: Literal["vllm"] = "vllm"
    switches_inside_generation: ClassVar[bool] = True  # ``rollout.partial_rollouts``: paused and installed between steps
    mode: Literal["server", "inprocess"] = "server"
    """Talk to its server, or run ``vllm.LLM`` inside the node."""
    max_lora_rank: int = Field(0, ge=0)
    """Serve LoRA versions announced as adapters (``trainer.lora.announce: adapter``) through vLLM's LoRA support, up to
    this rank (0: off; a LoRA policy then announces merged weights)."""
    cpu_kv_cache_gib: float = Field(1.0, gt=0)
    """Without a GPU (vLLM's CPU build): GiB of memory for the KV cache (vLLM's ``VLLM_CPU_KVCACHE_SPACE``, unless that
    is set). vLLM's own default reserves most of the machine's memory and refuses to start beside other roles."""

    @property
    def serves_adapters(self) -> bool:
        return self.max_lora_rank > 0

    @model_validator(mode="after")
    def _server_only(self) -> VllmOptions:
        server_fields = changed(self, {"url", "args", "startup_timeout"})
        if self.mode == "inprocess" and server_fields:
            raise ValueError(f"{', '.join(server_fields)} applies to mode: server only; drop it or set mode: server")
        return self
