"""Recipe configuration: pydantic models (``extra="forbid"``), loaded from YAML.

A bad recipe fails at load with the field named (``trainer.lr: Input should be greater than
0``). The launcher dumps the resolved recipe next to the run, and every role process reads
that same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from astraflow.algorithms.config import AlgorithmsConfig
from astraflow.streams.subjects import check_token

if TYPE_CHECKING:
    from astraflow.streams.plane import Topology


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(Strict):
    pretrained: str | None = None
    """Local path or hub id of a pretrained model (GPU recipes). None: build a tiny Qwen2 from the fields below."""
    tokenizer: str = "byt5"
    """``byt5`` (byte-level, needs no files) or a tokenizer path / id."""
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(256, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    max_positions: int = Field(64, gt=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the model on each role (weights travel as bf16 regardless)."""
    seed: int = 0


class DataConfig(Strict):
    type: Literal["arithmetic", "reasoning_gym"] = "arithmetic"
    """Prompt source: generated digit arithmetic, or a reasoning-gym task (offline)."""
    max_operand: int = Field(19, ge=1)
    """arithmetic: operands are drawn from 0..max_operand."""
    rg_task: str = "basic_arithmetic"
    """reasoning_gym: the dataset name."""
    n_train: int = Field(300, gt=0)
    n_eval: int = Field(100, gt=0)
    """Held-out prompts, disjoint from the training prompts."""
    seed: int = 0


class SFTConfig(Strict):
    steps: int = Field(0, ge=0)
    """Supervised warm-start steps the trainer takes on the training answers before version 0."""
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(64, gt=0)


class RolloutConfig(Strict):
    nodes: int = Field(1, ge=0)
    """Rollout workers `astraflow up` starts in the default pool."""
    pool: str = "raas"
    engine: Literal["hf", "sglang", "vllm", "scripted"] = "hf"
    tasks_per_generate: int = Field(4, gt=0)
    """Tasks a node pulls and generates together (one batched generate call)."""
    max_new_tokens: int = Field(8, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    threads: int = Field(1, gt=0)
    """torch threads per rollout process."""


class DataflowConfig(Strict):
    group_size: int = Field(8, ge=1)
    groups_per_batch: int = Field(8, ge=1)
    max_tasks_in_flight: int = Field(16, ge=1)
    max_staleness: int = Field(2, ge=0)
    """A sample may lag the trainer by at most this many versions."""
    max_batch_backlog: int = Field(2, ge=1)
    """Batch serving pauses while the trainer's unconsumed batches reach this bound."""
    algorithms: AlgorithmsConfig = AlgorithmsConfig()


class TrainerConfig(Strict):
    backend: Literal["torch", "deepspeed"] = "torch"
    steps: int = Field(40, gt=0)
    """Optimizer steps (= weight versions after version 0) before the run ends."""
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    keyframe_every: int = Field(10, ge=1)
    """A full keyframe every K versions (and at start); deltas in between."""
    threads: int = Field(1, gt=0)
    seed: int = 0


class EvalConfig(Strict):
    every: int = Field(10, ge=1)
    """Evaluate held-out prompts every N versions (and version 0 and the last)."""
    enabled: bool = True
    policy: str | None = None
    """Policy to evaluate (default: the first)."""


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


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Recipe(Strict):
    name: str
    workflow: str = "single_turn"
    """Registered workflow (see ``astraflow.rollout.workflows``)."""
    reward: str = "arithmetic"
    """Registered reward (see ``astraflow.rollout.rewards``)."""
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
    dataflow: DataflowConfig = DataflowConfig()
    eval: EvalConfig = EvalConfig()

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

    @field_validator("name", "workflow")
    @classmethod
    def _token(cls, v: str) -> str:
        return check_token("name", v)

    @model_validator(mode="after")
    def _fits(self) -> "Recipe":
        if self.dataflow.max_tasks_in_flight < self.dataflow.groups_per_batch:
            raise ValueError("dataflow.max_tasks_in_flight must be >= dataflow.groups_per_batch, or no batch ever fills")
        if self.eval.policy is not None and self.eval.policy not in self.policies:
            raise ValueError(f"eval.policy {self.eval.policy!r} is not one of the policies {list(self.policies)}")
        return self

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

    def topology(self) -> "Topology":
        from astraflow.streams.plane import Topology

        return Topology(policies=self.policy_names, pools=(self.rollout.pool,))


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
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise RecipeError(f"override {item!r} must look like section.field=value")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return parse_recipe(data, str(p))


def dump_recipe(recipe: Recipe, path: Path) -> None:
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
