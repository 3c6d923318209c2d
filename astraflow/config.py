"""Recipe configuration: pydantic models (``extra="forbid"``), loaded from YAML.

A bad recipe fails at load with the field named (``trainer.lr: Input should be greater than
0``). The launcher dumps the resolved recipe next to the run, and every role process reads
that same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from astraflow.algorithms.config import AlgorithmsConfig
from astraflow.registry import BACKENDS, SOURCES, EngineOptions, LossOptions, Options, UnknownName, WorkflowOptions, load_plugins
from astraflow.streams.subjects import check_token

if TYPE_CHECKING:
    from astraflow.streams.plane import Topology


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


EXPERT_FIELDS = ("num_experts", "experts_per_token", "moe_intermediate_size")


class ModelConfig(Strict):
    pretrained: str | None = None
    """Local path or hub id of a pretrained model (GPU recipes). None: build a tiny model of ``arch`` from the fields below."""
    tokenizer: str = "byt5"
    """``byt5`` (byte-level, needs no files) or a tokenizer path / id."""
    arch: Literal["qwen2", "qwen3_moe"] = "qwen2"
    """What is built from the fields below: ``qwen2`` (dense) or ``qwen3_moe`` (Mixture-of-Experts: every layer's MLP is
    ``num_experts`` experts, ``experts_per_token`` of them routed per token, top-k with renormalised weights)."""
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(256, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    max_positions: int = Field(64, gt=0)
    attention_window: int | None = Field(None, gt=0)
    """Sliding-window attention: each token attends to itself and the ``attention_window - 1`` before it, at a cost
    linear in the row length (``astraflow/window_attention.py``), so long rows train and generate on a CPU.
    None: full causal attention. Built models only (not with ``pretrained``)."""
    num_experts: int | None = Field(None, ge=2)
    """qwen3_moe: experts per layer (default 8)."""
    experts_per_token: int | None = Field(None, ge=1)
    """qwen3_moe: experts each token is routed to (top-k; default 2)."""
    moe_intermediate_size: int | None = Field(None, gt=0)
    """qwen3_moe: hidden width of one expert (default ``intermediate_size / experts_per_token``)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the model on each role (weights travel as bf16 regardless)."""
    seed: int = 0

    @model_validator(mode="after")
    def _built_model_fields(self) -> ModelConfig:
        if self.attention_window is not None and self.pretrained:
            raise ValueError("model.attention_window applies to models built from the config; a pretrained model keeps its "
                             "own attention (remove one of the two)")
        given = [f for f in EXPERT_FIELDS if getattr(self, f) is not None]
        if self.arch != "qwen3_moe":
            if given:
                raise ValueError(f"{given[0]} applies only to arch qwen3_moe (arch is {self.arch})")
            return self
        if self.pretrained:
            raise ValueError("arch qwen3_moe builds a model from this config; a pretrained model brings its own architecture")
        self.num_experts = self.num_experts or 8
        self.experts_per_token = self.experts_per_token or 2
        self.moe_intermediate_size = self.moe_intermediate_size or max(1, self.intermediate_size // self.experts_per_token)
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) must not exceed num_experts ({self.num_experts})")
        return self


class DataConfig(Strict):
    type: str = "arithmetic"
    """Prompt source: generated digit arithmetic, a reasoning-gym task (offline), a local JSONL file, or a source a
    plug-in registers (``rollout.plugins``, or a package's entry point in ``astraflow.source``; ``tasks.py``)."""
    min_operand: int = Field(0, ge=0)
    """arithmetic: the smallest operand (``10`` with ``max_operand: 99``: two-digit additions only)."""
    max_operand: int = Field(19, ge=1)
    """arithmetic: operands are drawn from min_operand..max_operand."""
    rg_task: str = "basic_arithmetic"
    """reasoning_gym: the dataset name."""
    path: str | None = None
    """jsonl: file with one problem per line (relative paths are resolved against the recipe folder)."""
    prompt_key: str = "prompt"
    """jsonl: field holding the prompt."""
    answer_key: str = "answer"
    """jsonl: field holding the reference answer (other fields go to the task's meta)."""
    n_train: int = Field(300, gt=0)
    n_eval: int = Field(100, gt=0)
    """Held-out prompts, disjoint from the training prompts."""
    seed: int = 0


    @model_validator(mode="after")
    def _needs_path(self) -> DataConfig:
        if self.type == "jsonl" and not self.path:
            raise ValueError("data.path is required when data.type is jsonl")
        if self.min_operand > self.max_operand:
            raise ValueError(f"data.min_operand ({self.min_operand}) must not exceed data.max_operand ({self.max_operand})")
        return self


class SFTConfig(Strict):
    steps: int = Field(0, ge=0)
    """Supervised warm-start steps the trainer takes before version 0: on the training prompts' reference answers,
    or on ``demonstrations``."""
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(0, ge=0)
    """Steps over which the learning rate rises linearly from ``lr / warmup_steps`` to ``lr`` (constant after; at most ``steps``). A
    high ``lr`` without warmup can leave some seeds stuck at a plateau (``recipes/arithmetic/hard.yaml``)."""
    batch_size: int = Field(64, gt=0)
    demonstrations: str | None = None
    """A JSONL of multi-turn demonstrations (relative paths: the recipe folder), one episode a line as
    ``astraflow demos`` records it: the prompt, then segments of text the model wrote (trained on) and text the
    workflow inserted (tool output, observations: masked out). Only episodes of training prompts are used.
    None: train on ``prompt + answer``."""
    threads: Annotated[int, Field(gt=0)] | Literal["auto"] = "auto"
    """torch threads of the warm start; ``auto``: under ``astraflow up`` the machine's usable cores shared by the
    trainers that warm-start (every other role idles until version 0 is announced: train/threads.py), alone as
    ``trainer.threads: auto``. A warm start redone after a crash needs the same count: ``up`` writes it down."""

    @model_validator(mode="after")
    def _warmup_within_steps(self) -> SFTConfig:
        if self.steps and self.warmup_steps > self.steps:
            raise ValueError(f"sft.warmup_steps ({self.warmup_steps}) must not exceed sft.steps ({self.steps})")
        return self


class RolloutConfig(Strict):
    """What every rollout node does: sampling, placement, and the engine that generates (with its own options)."""

    nodes: int = Field(1, ge=0)
    """Rollout workers `astraflow up` starts in the default pool."""
    nice: int = Field(10, ge=0, le=19)
    """CPU priority (``nice``) `astraflow up` starts its rollout nodes and evaluator at, trainers staying at 0: where
    the roles share a machine's cores, generation yields them to the trainers' steps, the bottleneck of a run on one
    machine (a node that preempts a step slows the whole loop, itself included). 0: no yielding."""
    pool: str = "raas"
    tasks_per_generate: int = Field(4, gt=0)
    """A node's generation slots: the tasks it works on at once. It admits a task whenever one finishes (each
    task its own workflow call), so a slow task holds one slot, not the node; the engine batches the slots'
    requests together (``hf``: calls waiting while a batch runs share the next one)."""
    max_new_tokens: int = Field(8, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    threads: int = Field(1, gt=0)
    """torch threads per rollout process."""
    region: str = ""
    """Region label nodes carry in heartbeats (``astraflow worker rollout --region`` overrides it)."""
    weights_domain: str | None = None
    """JetStream domain whose mirrors a node reads weights from (a region's leafnode, e.g. ``leaf``);
    None: the run's own streams. ``astraflow worker rollout --weights-domain`` overrides it."""
    hardware: str = ""
    """Hardware label nodes carry in heartbeats (default: ``cuda`` or ``cpu``, as detected)."""
    drain_timeout: float = Field(30.0, ge=0)
    """A node told to stop waits this long for the tasks it holds to finish, then naks them back to the pool."""
    partial_rollouts: bool = False
    """Apply a new weight version inside a generation: the engine pauses between decoding steps, loads it, and the
    generation goes on under it (its KV cache recomputed), so a long completion does not hold a version back. Each
    token carries the version that sampled it, which the trainer's per-token correction uses. Engines that can:
    ``hf`` and ``vllm`` (its scheduler paused, its running requests preempted and recomputed; versions that are LoRA
    adapters still land between generations). Off: versions land between generations."""
    shared_base: bool = False
    """Every policy on one base model: a node holds the base once with each policy's LoRA adapter beside it (peft,
    unmerged; ``rollout/engines/shared_base.py``) and serves each task with its policy's adapter, instead of one merged
    model per policy. Needs every policy to train LoRA announcing adapters (``trainer.lora``) over the same model, on
    the ``hf`` engine. The warm start is then the base's, trained once for every policy before the roles start
    (``train/base_warm_start.py``: ``astraflow up`` does it; by hand, ``astraflow warm-start``)."""
    plugins: list[str] = []
    """Modules (``pkg.mod``) or ``.py`` files that register the recipe's own workflows, rewards, tools or engines.
    They are imported when the recipe is loaded (before ``engine`` and ``workflow`` are resolved), in every role."""
    engine: EngineOptions = Field("hf", validate_default=True)
    """Generation runtime by registered name, with its options: ``hf`` (transformers in-process, the default),
    ``sglang`` / ``vllm`` (their servers, launched or attached with ``url``), ``scripted`` (benchmarks), or a
    plug-in's. The option models live beside the engines (``astraflow/rollout/engines/options.py``)."""

    @field_validator("plugins")
    @classmethod
    def _import_plugins(cls, paths: list[str]) -> list[str]:
        load_plugins(paths)
        return paths

    @field_validator("engine", mode="before")
    @classmethod
    def _default_engine(cls, v: Any) -> Any:
        """Options without a ``type`` are the default engine's (``--set rollout.engine.dtype=bfloat16`` on a recipe that
        names no engine)."""
        return {"type": "hf", **v} if isinstance(v, dict) and "type" not in v else v

    @model_validator(mode="after")
    def _engine_switches(self) -> RolloutConfig:
        if self.partial_rollouts and not getattr(type(self.engine), "switches_inside_generation", False):
            raise ValueError(f"partial_rollouts: engine {self.engine.type} cannot switch weights inside a generation "
                             f"(hf and vllm can); drop partial_rollouts or use engine: hf or vllm")
        return self


class AutoscaleConfig(BaseModel):
    """Autoscale advice for the rollout pool (``dataflow.autoscale`` in a recipe)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    hi: float = Field(0.25, ge=0, le=1)
    """Grow the pool while the trainers wait for batches more than this share of the time."""
    lo: float = Field(0.05, ge=0, le=1)
    """Shrink it while they wait less than this share (between lo and hi: hold)."""
    min_nodes: int = Field(1, ge=0)
    """Never advise fewer rollout nodes than this."""
    max_nodes: int = Field(8, ge=1)
    """Never advise more rollout nodes than this."""
    max_step: int = Field(2, ge=1)
    """Nodes added or removed per decision at most."""
    window_s: float = Field(30.0, gt=0)
    """Seconds over which wait fraction, rates and node busy time are measured."""

    @model_validator(mode="after")
    def _bands(self) -> AutoscaleConfig:
        if self.lo > self.hi:
            raise ValueError(f"autoscale.lo ({self.lo}) must not exceed autoscale.hi ({self.hi}): they bound the dead band")
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"autoscale.min_nodes ({self.min_nodes}) must not exceed autoscale.max_nodes ({self.max_nodes})")
        return self


class DataflowConfig(Strict):
    group_size: int = Field(8, ge=1)
    groups_per_batch: int = Field(8, ge=1)
    max_tasks_in_flight: int = Field(16, ge=1)
    max_staleness: int = Field(2, ge=0)
    """A sample may lag the trainer by at most this many versions."""
    max_batch_backlog: int = Field(2, ge=1)
    """Batch serving pauses while the trainer's unconsumed batches reach this bound."""
    algorithms: AlgorithmsConfig = AlgorithmsConfig()
    mode: Literal["async", "sync"] = "async"
    """``async``: tasks flow within the staleness budget while trainers train. ``sync``: the
    trainer-centred baseline: release one batch of tasks per version, wait until every one has
    come back and the batch is trained (version v+1 announced), then release the next."""
    task_timeout_s: float | None = Field(None, gt=0)
    """Each task's deadline is its issue time plus this (``Task.deadline``); None: no deadline."""
    late_policy: Literal["keep", "downweight", "drop"] = "keep"
    """A group completing after its task's deadline is kept, kept with its advantages scaled by
    ``late_weight``, or dropped (fate ``dropped:expired``); each case is counted."""
    late_weight: float = Field(0.5, ge=0, le=1)
    """``late_policy: downweight``: factor on the advantages of a late group."""
    autoscale: AutoscaleConfig = AutoscaleConfig()
    """Target rollout-pool size from trainer wait and data rates (published; ``up --autoscale`` acts)."""
    rescore_costly: float = Field(0.1, ge=0, le=1)
    """Share of trajectories whose reward is costly to compute (tests in a sandbox) that the dataflow scores again
    to check the node's claim (a cheap reward is scored again every time; ``dataflow/claims.py``)."""
    trust_claims: bool = False
    """Take the prompts and rewards nodes claim as they come: no check against the issued task and no re-scoring
    (a test workflow whose prompts are its own). Value checks still apply."""
    quarantine_after: int = Field(3, ge=0)
    """Tasks a rollout node may fail (a trajectory of it refused, ``invalid:*``) before it is quarantined: its
    trajectories refused, its credential revoked on the embedded server, until ``astraflow node admit`` (0: never;
    ``dataflow/reputation.py``)."""


class LoraConfig(Strict):
    """Low-rank adapters (``peft``) trained instead of every weight (train/lora.py)."""

    rank: int = Field(8, gt=0)
    alpha: int = Field(16, gt=0)
    """The adapters' scale is alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1)
    """Names (last component) of the linear layers that get an adapter: by default every linear layer of a decoder
    block (attention and MLP). The attention projections alone learn less: on ``recipes/arithmetic`` rank 8 on them
    rose +0.09 on a seed where every layer rose +0.28 (BENCHMARKS.md, "LoRA against full fine-tuning")."""
    announce: Literal["adapter", "merged"] = "adapter"
    """What a version carries on the weight plane. ``adapter``: the adapters alone, against the base model's digest (a few
    KiB to MiB a version; nodes merge them into a copy of their base: weights/adapters.py). ``merged``: the full merged
    weights, as full fine-tuning announces them (for engines that take whole states only: sglang, vllm)."""


class TrainerConfig(Strict):
    backend: str = "torch"
    """``torch`` (one process, CPU or GPU), ``deepspeed`` (ZeRO 1-3; one process on CPU with gloo, or
    several GPUs under the ``deepspeed`` launcher), or one a plug-in registers (``trainer.plugins``, or a
    package's entry point in ``astraflow.backend``). See docs/training.md."""
    steps: int = Field(40, gt=0)
    """Optimizer steps (= weight versions after version 0) before the run ends."""
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    plugins: list[str] = []
    """Modules (``pkg.mod``) or ``.py`` files that register the recipe's own losses; imported when the recipe is
    loaded, before ``loss`` is resolved."""
    loss: LossOptions = Field("ppo", validate_default=True)
    """Policy loss by registered name, with its options: ``ppo`` (PPO-clip against the behaviour logprobs,
    clip-higher, dual-clip), ``decoupled_ppo`` (trust region around π_prox, truncated IS against π_behave),
    ``m2po`` (second-moment mask, no ratio clip), or a plug-in's. The option models live beside the losses
    (``astraflow/train/losses/options.py``)."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses (and the KL penalty) reduce to a scalar (token-mean: DAPO; seq-mean-token-mean: original GRPO)."""
    max_logprob_gap: float | None = Field(4.0, gt=0)
    """Tokens checked against the model: a trajectory whose behaviour logprobs differ from the policy's own by more
    than this many nats per trained token on average (mean |log π_θ − log π_behave|) is left out of the step, counted
    as ``suspect_trajectories`` (tokens or logprobs a node fabricated; docs/training.md). null: no check."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to a frozen reference policy (the version-0 weights); 0: no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of KL(π_θ ‖ π_ref) from sampled tokens (Schulman): k1 = d, k2 = d²/2, k3 = e^-d + d - 1."""
    micro_batch_tokens: int | None = Field(None, gt=0)
    """Token budget (rows x padded length) of one forward/backward; a batch is split into micro-batches that fit
    it and their gradients accumulate into one optimizer step, normalised over the whole batch. null: one pass."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: mixed precision (torch: fp32 weights and optimizer, bf16 autocast; deepspeed: its bf16 mode)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the torch backend trains (auto: cuda when available). The deepspeed backend uses its accelerator."""
    zero_stage: int = Field(1, ge=0, le=3)
    """deepspeed: ZeRO stage (0: plain data parallel, 1: optimizer state, 2: + gradients, 3: + parameters)."""
    peer_timeout: float = Field(60.0, gt=0)
    """Several ranks (torchrun / deepspeed launcher): a rank that hears no heartbeat from a peer for this many seconds
    exits with code 75, so that its supervisor restarts the whole group from the last checkpoint (docs/training.md)."""
    unrouted_experts: Literal["step", "hold"] = "step"
    """Mixture-of-Experts models, torch backend: ``step``: plain AdamW, whose momentum and weight decay move an expert
    even in a step where no token was routed to it; ``hold``: such an expert keeps its weights and AdamW moments
    through the step (lazy per expert), so it stays out of the weight delta (train/experts.py, docs/training.md)."""
    routing: Literal["own", "measured", "replayed"] = "own"
    """Mixture-of-Experts models: whose expert choices the trainer's forward takes (astraflow/moe_routing.py). ``own``:
    its own top-k, nothing recorded. ``measured``: the nodes record each position's experts with the trajectory and
    the trainer reports the share its own top-k differs on (``routing_mismatch``). ``replayed``: the trainer forces the
    recorded experts, weighted by its own router, when it recomputes logprobs and steps (routing replay); it still
    reports the mismatch. Engines that record: ``hf`` (a node whose engine cannot fails at start); a trajectory
    without routing (a node of your own) is routed by the trainer."""
    max_grad_norm: float = Field(1.0, gt=0)
    keyframe_every: int = Field(10, ge=1)
    """A full keyframe every K versions (and at start); deltas in between."""
    checkpoint_every: int = Field(10, ge=1)
    """With ``--checkpoint-dir``: checkpoint every N versions, snapshotted before that version is announced and
    written in the background (group commit, ``train/group_commit.py``); a batch is acked once a durable checkpoint
    covers its version. A restart replays the announced batches after its checkpoint and is exact when each replayed
    version hashes to the announced digest. At most half of ``plane.weights_history`` (the replay reads those
    announcements back)."""
    checkpoint_keep: int = Field(2, ge=1)
    """Checkpoints kept on disk (the newest ones)."""
    publish: Literal["auto", "behind", "inline"] = "auto"
    """When a version is published (the bf16 delta encoded and the state digest taken: CPU work; then stored and
    announced): ``behind`` the next step, which pays where the step leaves the CPU free (a step on a GPU);
    ``inline``, before the next batch is pulled: on a CPU trainer the step and the publish share the same cores, and
    running them together slows the step by more than it hides (BENCHMARKS.md, "Against the in-process loop").
    ``auto``: behind when the trainer trains on an accelerator, inline on CPU."""
    threads: Annotated[int, Field(gt=0)] | Literal["auto"] = "auto"
    """torch threads of the trainer; ``auto``: the cores its process may run on (``os.sched_getaffinity``) less those
    the other roles ``astraflow up`` starts on the machine take (train/threads.py). Resuming exactly needs the same
    count: ``up`` writes the number it chose into the run's recipe.yaml."""
    cores: list[Annotated[int, Field(ge=0)]] | Literal["auto", "shared"] = "auto"
    """CPUs the trainer runs on once its warm start is done (the warm start takes every usable core). ``auto``: under
    ``astraflow up`` on a CPU-only machine, ``threads`` cores of its own, which up keeps every other role (nodes,
    evaluator, dataflow, nats-server) off, when the cores left hold every node's ``rollout.threads``; else ``shared``
    (train/threads.py). A step preempted by generation slows the whole loop; a trainer alone on its core runs its step
    as fast as the in-process loop does (BENCHMARKS.md, "Against the in-process loop"). ``shared``: no pinning (a
    rollout-bound run on few cores, where generation should have the trainer's idle time). A list: those CPUs, kept
    from the other roles too. ``up`` writes what it chose into the run's recipe.yaml."""
    lora: LoraConfig | None = None
    """Train low-rank adapters on ``target_modules`` (base weights frozen) instead of every weight; each version is
    announced as the adapters alone (``announce: adapter``) or the merged full weights (torch and deepspeed; train/lora.py)."""
    seed: int = 0

    @field_validator("plugins")
    @classmethod
    def _import_plugins(cls, paths: list[str]) -> list[str]:
        load_plugins(paths)
        return paths

    @model_validator(mode="after")
    def _known_backend(self) -> TrainerConfig:  # after the plugins, which may register it
        try:  # the factories import their packages only when called: naming one imports no torch
            BACKENDS.get(self.backend)
        except UnknownName as e:
            raise ValueError(f"backend: {e}") from None
        if self.lora is not None and self.backend not in ("torch", "deepspeed"):
            raise ValueError(f"lora: the {self.backend} backend does not train adapters; use backend: torch or deepspeed")
        return self

    @field_validator("cores")
    @classmethod
    def _cores_listed_once(cls, cores: list[int] | str) -> list[int] | str:
        if isinstance(cores, list) and (not cores or len(set(cores)) != len(cores)):
            raise ValueError(f"cores must name at least one CPU, each once: {cores}")
        return cores


class EvalConfig(Strict):
    every: int = Field(10, ge=1)
    """Evaluate held-out prompts every N versions (and version 0 and the last)."""
    enabled: bool = True
    policy: str | None = None
    """Policy to evaluate (default: the first)."""
    k: int = Field(1, ge=1)
    """Samples per held-out prompt for ``avg@k`` / ``pass@k`` (1: the greedy answer only). With k > 1 each
    prompt is also sampled k times at ``temperature``; the greedy ``reward`` is always recorded."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the k samples (the greedy pass ignores it)."""
    nice: int = Field(19, ge=0, le=19)
    """CPU priority (``nice``) the evaluator lowers itself to once started (its model built), where that is lower than
    the one it was started at (``up``: ``rollout.nice``): where the roles share cores, an evaluation then takes the
    cycles generation leaves instead of part of the node's core while the trainer waits for the node. Its start-up
    keeps the priority it was started at, so that it holds its first version before retention deletes it."""


class PlaneConfig(Strict):
    """How the run's streams and consumers are set up on the server."""

    replicas: int = Field(1, ge=1, le=5)
    """Stream replicas: 1 on a single server, 3 on a 3-node cluster (jetstream/cluster/)."""
    task_ack_wait: float = Field(60.0, gt=0)
    """Seconds before a task held by a silent (dead) rollout node is redelivered."""
    traj_ack_wait: float = Field(30.0, gt=0)
    """Seconds before trajectories held by a dead dataflow are redelivered."""
    batch_ack_wait: float = Field(300.0, gt=0)
    """Seconds before a batch held by a dead trainer is redelivered."""
    max_deliver: int = Field(20, ge=2)
    """Deliveries of a task before it is dead-lettered."""
    weights_history: int = Field(64, ge=2)
    """Weight announcements kept per policy (retention of payloads follows them)."""
    mirror_domains: list[str] = []
    """JetStream domains of region leaves that mirror the weights (``astraflow region mirrors``): the trainer's
    retention deletes old versions there too, so a mirror keeps what the hub keeps."""
    server_gone_timeout: float = Field(120.0, gt=0)
    """A role whose server has been unreachable this long leaves (shorter outages are ridden through)."""
    max_consumers: int = Field(100_000, ge=1000)
    """Consumers each of the run's streams allows. Every rollout node reads the announcements through one, and a
    many-chunk version through another; nats-server 2.15 allows 1,000 to a stream that names no limit."""
    fate_ttl: float = Field(24 * 3600, gt=0)
    """Seconds a per-task fate record stays in the run's fates bucket."""


class PolicyConfig(Strict):
    """One trainable policy: its model, warm start and trainer. One trainer process each."""

    name: str
    model: ModelConfig = ModelConfig()
    sft: SFTConfig = SFTConfig()
    trainer: TrainerConfig = TrainerConfig()

    @field_validator("name")
    @classmethod
    def _token(cls, v: str) -> str:
        return check_token("policy", v)

    @model_validator(mode="after")
    def _recorded_routing(self) -> PolicyConfig:
        if self.trainer.routing != "own" and self.model.arch != "qwen3_moe" and not self.model.pretrained:
            raise ValueError(f"trainer.routing: {self.trainer.routing} applies only to Mixture-of-Experts models "
                             f"(model.arch is {self.model.arch})")
        return self

    @model_validator(mode="after")
    def _held_experts(self) -> PolicyConfig:
        if self.trainer.unrouted_experts == "hold":
            if self.model.arch != "qwen3_moe":
                raise ValueError(
                    f"trainer.unrouted_experts: hold applies only to Mixture-of-Experts models (model.arch is {self.model.arch})"
                )
            if self.trainer.backend != "torch":
                raise ValueError("trainer.unrouted_experts: hold needs the torch backend (DeepSpeed's optimizer owns flat "
                                 "partitions of the weights, not expert rows)")
        return self


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, mapping by mapping. An option mapping naming another ``type`` replaces the
    base's (``loss: {type: ppo}`` over ``{type: m2po, tau: 0.01}`` drops ``tau``); a bare name is ``{type: name}``."""
    out = dict(base)
    for k, v in over.items():
        b = out.get(k)
        if isinstance(v, dict) and isinstance(b, str):
            b = {"type": b}
        if isinstance(v, dict) and isinstance(b, dict) and v.get("type", b.get("type")) == b.get("type"):
            out[k] = _merge(b, v)
        else:
            out[k] = v
    return out


class Recipe(Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    model: ModelConfig = ModelConfig()
    """Default model of every policy."""
    sft: SFTConfig = SFTConfig()
    """Default warm start of every policy."""
    trainer: TrainerConfig = TrainerConfig()
    """Default trainer of every policy."""
    policies: dict[str, PolicyConfig] = {}
    """Policies by name; the first one solves the tasks. Each entry overrides the defaults above
    (``policies: {solver: {}, verifier: {trainer: {lr: 1e-4}}}``); a list of names takes them as is."""
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    workflow_options: WorkflowOptions = Field("single_turn", alias="workflow", validate_default=True)
    """``workflow:`` in YAML. The registered workflow a task is played with, and its options
    (``{type: multi_turn_tools, max_turns: 3, tools: [bm25]}``; a bare name takes the defaults). Validated after
    ``rollout``, whose plugins may register it. The option models live beside the workflows
    (``astraflow/rollout/workflows/options.py``)."""
    reward: str = "arithmetic"
    """Registered reward (see ``astraflow.rollout.rewards``)."""
    dataflow: DataflowConfig = DataflowConfig()
    eval: EvalConfig = EvalConfig()
    plane: PlaneConfig = PlaneConfig()

    @model_validator(mode="before")
    @classmethod
    def _resolve_policies(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        pol = data.get("policies") or {"solver": {}}
        if isinstance(pol, list):
            pol = {name: {} for name in pol}
        if not isinstance(pol, dict):
            raise ValueError("policies must be a mapping of name -> overrides, or a list of names")
        defaults = {k: data.get(k) or {} for k in ("model", "sft", "trainer")}
        defaults = {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in defaults.items()}
        resolved = {}
        for name, over in pol.items():
            over = over.model_dump() if isinstance(over, BaseModel) else dict(over or {})
            over.pop("name", None)
            resolved[name] = {"name": name, **{k: _merge(defaults[k], over.pop(k, {}) or {}) for k in defaults}, **over}
        return {**data, "policies": resolved}

    @field_validator("name")
    @classmethod
    def _token(cls, v: str) -> str:
        return check_token("name", v)

    @field_validator("workflow_options")
    @classmethod
    def _workflow_token(cls, v: Options) -> Options:
        check_token("workflow", v.type)  # tasks travel on task.{workflow}
        return v

    @model_validator(mode="after")
    def _known_source(self) -> Recipe:  # after rollout.plugins, which may register it
        try:
            SOURCES.get(self.data.type)
        except UnknownName as e:
            raise ValueError(f"data.type: {e}") from None
        return self

    @model_validator(mode="after")
    def _fits(self) -> Recipe:
        if self.dataflow.max_tasks_in_flight < self.dataflow.groups_per_batch:
            raise ValueError("dataflow.max_tasks_in_flight must be >= dataflow.groups_per_batch, or no batch ever fills")
        if self.eval.policy is not None and self.eval.policy not in self.policies:
            raise ValueError(f"eval.policy {self.eval.policy!r} is not one of the policies {list(self.policies)}")
        for name, policy in self.policies.items():  # a restart replays up to ~2 x checkpoint_every announced versions
            if 2 * policy.trainer.checkpoint_every > self.plane.weights_history:
                raise ValueError(f"policy {name!r}: trainer.checkpoint_every ({policy.trainer.checkpoint_every}) must be at most "
                                 f"half of plane.weights_history ({self.plane.weights_history}): a restart reads back the "
                                 "announcements since its last checkpoint; raise plane.weights_history or lower checkpoint_every")
        for name, policy in self.policies.items():
            lora = policy.trainer.lora
            if lora is None or lora.announce != "adapter":
                continue
            if not getattr(self.rollout.engine, "serves_adapters", False):
                raise ValueError(f"policy {name!r}: trainer.lora.announce: adapter, and engine {self.rollout.engine.type} takes whole "
                                 "states only (hf serves adapters, vllm with max_lora_rank); set trainer.lora.announce: merged")
            max_rank = getattr(self.rollout.engine, "max_lora_rank", None)
            if max_rank is not None and lora.rank > max_rank:
                raise ValueError(f"policy {name!r}: trainer.lora.rank {lora.rank} is above rollout.engine.max_lora_rank {max_rank}")
            if max_rank is not None and policy.sft.steps:
                raise ValueError(f"policy {name!r}: its warm start (sft.steps) trains every weight, and vllm serves adapters over "
                                 "the model it loads; announce merged weights (trainer.lora.announce: merged) or drop the warm start")
        if self.rollout.shared_base:
            self._check_shared_base()
        for name, policy in self.policies.items():  # no prompt would fit: every task would be turned away, for ever
            if policy.model.pretrained is None and self.rollout.max_new_tokens >= policy.model.max_positions:
                raise ValueError(f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) leaves no room for a prompt in "
                                 f"policy {name!r}'s context (model.max_positions {policy.model.max_positions})")
        return self

    def _check_shared_base(self) -> None:
        if self.rollout.engine.type != "hf":
            raise ValueError(f"rollout.shared_base: engine {self.rollout.engine.type} does not serve several adapters on one "
                             "base (hf does)")
        models = {p.model.model_dump_json() for p in self.policies.values()}
        if len(models) > 1:
            raise ValueError("rollout.shared_base: the policies' models differ; one base serves them all (set one model)")
        for name, policy in self.policies.items():
            lora = policy.trainer.lora
            if lora is None or lora.announce != "adapter":
                raise ValueError(f"rollout.shared_base: policy {name!r} must train LoRA announcing adapters (trainer.lora, "
                                 "announce: adapter)")
            if policy.trainer.routing != "own":
                raise ValueError(f"rollout.shared_base: policy {name!r}: trainer.routing needs an engine of its own")

    @property
    def workflow(self) -> str:
        """The workflow's registered name (the subject token of its tasks)."""
        return self.workflow_options.type

    @property
    def primary(self) -> str:
        """The policy tasks are addressed to (the first)."""
        return next(iter(self.policies))

    @property
    def policy_names(self) -> tuple[str, ...]:
        return tuple(self.policies)

    @property
    def eval_policy(self) -> str:
        return self.eval.policy or self.primary

    def topology(self) -> Topology:
        from astraflow.streams.plane import Topology

        p = self.plane
        return Topology(policies=self.policy_names, pools=(self.rollout.pool,), replicas=p.replicas, task_ack_wait=p.task_ack_wait,
                        traj_ack_wait=p.traj_ack_wait, batch_ack_wait=p.batch_ack_wait, max_deliver=p.max_deliver,
                        weights_history=p.weights_history, fate_ttl=p.fate_ttl, max_consumers=p.max_consumers)


class RecipeError(ValueError):
    """A recipe that does not load; the message names the field."""


def _format(err: ValidationError, source: str) -> str:
    lines = [f"invalid recipe {source}:"]
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        lines.append(f"  {loc}: {e['msg']}")
    return "\n".join(lines)


def parse_recipe(data: dict[str, Any], source: str = "<dict>") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format(e, source)) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load a recipe YAML (a file, or a folder holding ``recipe.yaml``) with ``a.b=value`` overrides."""
    p = Path(path)
    if p.is_dir():
        p = p / "recipe.yaml"
    if not p.exists():
        raise RecipeError(f"recipe {path} not found")
    data = yaml.safe_load(p.read_text()) or {}
    for section, key in _recipe_files(data):  # files named in the recipe are relative to its folder
        if isinstance(section[key], str) and not Path(section[key]).is_absolute():
            section[key] = str((p.parent / section[key]).resolve())
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise RecipeError(f"override {item!r} must look like section.field=value")
        keys = key.split(".")
        new = yaml.safe_load(value)
        for policy in _inheriting_policies(data, keys):  # a stored recipe spells every policy's defaults out
            _set(policy, keys, new)
        _set(data, keys, new)
    return parse_recipe(data, str(p))


_MISSING = object()


def _get(node: Any, path: list[str]) -> Any:
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(node: dict[str, Any], path: list[str], value: Any) -> None:
    *parents, leaf = path
    for part in parents:
        if isinstance(node.get(part), str):  # a bare name (engine: hf) opened for its options
            node[part] = {"type": node[part]}
        node = node.setdefault(part, {})
    node[leaf] = value


def _inheriting_policies(data: dict[str, Any], path: list[str]) -> list[dict[str, Any]]:
    """The policy entries that ``--set model|sft|trainer.…`` must reach besides the default: those that spell out
    the default's current value. A recipe as written leaves them out (they inherit), but the one a run directory
    keeps (``--resume``) is resolved, every policy's sections written in full; without this, ``--set
    trainer.steps=80`` on resume changed the default and no policy. A policy whose own value differs keeps it."""
    policies = data.get("policies")
    if path[0] not in ("model", "sft", "trainer") or len(path) < 2 or not isinstance(policies, dict):
        return []
    default = _get(data, path)
    return [over for over in policies.values()
            if isinstance(over, dict) and (found := _get(over, path)) is not _MISSING and found == default]


def _recipe_files(data: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Where a raw recipe names a file, as (section, key): ``data.path``, every ``sft.demonstrations``, and an agent
    given as ``file.py:function`` (``workflow.agent``)."""
    out = []
    if isinstance(data.get("data"), dict) and data["data"].get("path"):
        out.append((data["data"], "path"))
    workflow = data.get("workflow")
    if isinstance(workflow, dict) and isinstance(workflow.get("agent"), str) and ".py:" in workflow["agent"]:
        out.append((workflow, "agent"))
    policies: dict[str, Any] = data["policies"] if isinstance(data.get("policies"), dict) else {}
    for section in [data.get("sft"), *((over or {}).get("sft") for over in policies.values() if isinstance(over, dict))]:
        if isinstance(section, dict) and section.get("demonstrations"):
            out.append((section, "demonstrations"))
    return out


def dump_recipe(recipe: Recipe, path: Path) -> None:
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json", by_alias=True), sort_keys=False))
