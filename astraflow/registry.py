"""One way to plug in: a :class:`Registry` per kind of part, looked up by name.

Every kind a recipe or a role picks by name has one: engines, workflows and losses (here: a recipe
validates their options at load), rewards, tools, trainer backends, environments and the data
algorithms (beside their kind). A part joins its kind's registry the same way everywhere:

    @ENGINES.register("echo", EchoOptions)
    def build_echo(options, model_cfg, rollout_cfg, tokenizer) -> Engine: ...

Its module is then one of three: a built-in module of the registry's ``homes`` (imported on first
use); a plug-in module a recipe lists (``rollout.plugins``, ``trainer.plugins``), imported while the
recipe loads; or a module of a package outside the repository, named by an entry point in the
group ``astraflow.<kind>`` of that package's metadata (read only when a name is not yet known):

    [project.entry-points."astraflow.engine"]
    echo = "astraflow_echo:build_echo"

An unknown name is an :class:`UnknownName` (a ``ValueError``) naming the registered ones and how
to add more. Option models pick their part by ``type`` in a recipe:

    workflow: {type: multi_turn_tools, max_turns: 3, tools: [bm25]}
    rollout: {engine: {type: scripted, latency: pareto, latency_alpha: 1.2}}
    trainer: {loss: {type: m2po, tau: 0.004}}

An unknown ``type`` fails at load and names the registered ones. A field the chosen model does
not have also fails at load, with its location and where it belongs (``rollout.engine.latency_sigma:
not an option of engine hf (it is an option of scripted)``). A bare name (``engine: hf``) means
``{type: hf}``. A part registered without an option model gets a bare one (``type`` only).

Built-in option models of engines, workflows and losses live beside their implementations, in
light modules that import only pydantic and ``declare`` them; each registry imports that module
(``options_home``) to validate a recipe and its ``homes`` only to build a part. So neither this
module nor ``config`` imports a role package, and loading a recipe imports no torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Generic, Literal, TypeVar, cast

from pydantic import BaseModel, BeforeValidator, ConfigDict, SerializeAsAny, ValidationError, create_model
from pydantic_core import PydanticCustomError


class Options(BaseModel):
    """Base of every option model: ``type`` names the implementation, and unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    type: str


@dataclass(frozen=True)
class Claims:
    """What a workflow can know in advance about one role's trajectories, so that the dataflow checks a node's claims
    against the run instead of believing them (``dataflow/claims.py``). A workflow's option model lists one per role
    in the order of its ``policies`` (the task's own policy first) as ``claims``; a role it does not list is free.

    - ``prompt``: ``"issued"``: the trajectory's ``prompt_ids`` are the issued prompt's tokens, exactly (the prompt
      the task named, encoded by the policy's tokenizer); ``"free"``: the workflow builds the prompt (from another
      policy's answer, an environment, an agent's chat).
    - ``reward``: ``"rescored"``: the reward is the recipe's reward function of the decoded completion and the task's
      meta, so the dataflow scores it again; ``"bounded"``: it lies in ``reward_range`` (None: the reward function's
      declared range); ``"free"``: any finite value (an environment's sum of step rewards).
    """

    prompt: Literal["issued", "free"] = "free"
    reward: Literal["rescored", "bounded", "free"] = "free"
    reward_range: tuple[float, float] | None = None


DEFAULT_REWARD_RANGE = (-1.0, 1.0)  # the values of a reward that states no range (``rewards.reward_range``)

T = TypeVar("T")
V = TypeVar("V")
M = TypeVar("M", bound=type[BaseModel])


def type_name(model: type[BaseModel]) -> str:
    """The ``type`` an option model stands for: the default of its ``type`` field (``type: Literal["hf"] = "hf"``)."""
    field = model.model_fields.get("type")
    name = None if field is None else field.default
    if not isinstance(name, str):
        raise TypeError(f"{model.__name__} must declare its name as the default of type: type: Literal['name'] = 'name'")
    return name


class UnknownName(ValueError):
    """A name nothing of its kind is registered under: the message names the registered ones and how to add more."""

    def __init__(self, kind: str, name: str, registered: list[str], plugins: str | None) -> None:
        self.kind, self.name, self.registered = kind, name, registered
        recipe = f"a plug-in module listed in {plugins} or " if plugins else ""
        super().__init__(f"unknown {kind} {name!r}; registered: {', '.join(registered) or 'none'} "
                         f"({recipe}an entry point in group astraflow.{kind} registers more)")


class Registry(Generic[T]):
    """The parts of one kind by name, each with its option model; reads like a mapping from name to part."""

    def __init__(self, kind: str, *homes: str, options_home: str | None = None, plugins: str | None = None) -> None:
        self.kind = kind  # what messages call a member ("engine"); the entry-point group is astraflow.<kind>
        self.homes = homes  # modules that register the built-in parts, imported on first use
        self.options_home = options_home  # a light module that declares the built-in option models (default: the homes)
        self.plugins = plugins  # where a recipe lists the modules that register more ("rollout.plugins"), if anywhere
        self._parts: dict[str, T] = {}
        self._models: dict[str, type[BaseModel]] = {}

    @property
    def group(self) -> str:
        return f"astraflow.{self.kind}"

    def register(self, name: str, options: type[BaseModel] | None = None) -> Callable[[T], T]:
        """Decorator: register a part under ``name`` with its option model (none: the one declared for the name,
        else a bare one that takes no options). A later registration of the same name replaces it."""
        if options is not None and type_name(options) != name:
            raise ValueError(f"{self.kind} {name!r} registered with options of type {type_name(options)!r}")

        def deco(part: T) -> T:
            if options is not None:
                self._models[name] = options
            else:
                self._bare(name)
            self._parts[name] = part
            return part

        return deco

    def declare(self, model: M) -> M:
        """Decorator: record an option model ahead of its part, so a recipe validates without importing the part."""
        self._models[type_name(model)] = model
        return model

    def get(self, name: str) -> T:
        """The part registered as ``name``: a built-in, a loaded plug-in's, or an entry point's (loaded now)."""
        return self._find(self._parts, name, self.homes)

    def options(self, name: str) -> type[BaseModel]:
        """The option model of ``name``, importing no more than the light module that declares the built-in ones."""
        return self._find(self._models, name, self._option_modules())

    def names(self) -> list[str]:
        """Every name: registered, declared, or offered by an installed package's entry point (not loaded yet)."""
        self._import(self._option_modules())
        return sorted({*self._parts, *self._models, *(ep.name for ep in self._entry_points())})

    def unregister(self, name: str) -> None:
        """Forget ``name`` (a test's own part, once the test is done)."""
        self._parts.pop(name, None)
        self._models.pop(name, None)

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        """Registered, declared, or offered by an entry point; the installed packages are read only for a name not
        registered yet (a tool call asks on every turn)."""
        if not isinstance(name, str):
            return False
        self._import(self._option_modules())
        return name in self._parts or name in self._models or any(ep.name == name for ep in self._entry_points())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def items(self) -> list[tuple[str, T]]:
        return [(name, self.get(name)) for name in self.names()]

    def parse(self, value: Any) -> Any:
        """A name or a mapping with ``type`` -> that type's option model, validated (its errors keep their location)."""
        if isinstance(value, BaseModel) and "type" in type(value).model_fields:
            if self._models.get(getattr(value, "type")) is type(value):  # noqa: B009 (checked just above)
                return value
            value = value.model_dump()  # an option model of another kind, or replaced since: checked afresh
        if isinstance(value, str):
            value = {"type": value}
        if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
            raise ValueError(f"the {self.kind} must be a name or a mapping with a type ({{type: name, ...}}); "
                             f"registered: {', '.join(self.names())}")
        model = self.options(value["type"])
        foreign = [k for k in value if k not in model.model_fields]
        if foreign:  # say where the field belongs, not only that it is unknown here
            raise ValidationError.from_exception_data(model.__name__, [
                {"type": PydanticCustomError("extra_forbidden", "{message}", {"message": self._not_an_option(k, value["type"])}),
                 "loc": (k,), "input": value[k]} for k in foreign])
        return model.model_validate(dict(value))

    def _not_an_option(self, field: str, name: str) -> str:
        owners = [n for n, m in sorted(self._models.items()) if field in m.model_fields]
        where = f"it is an option of {', '.join(owners)}" if owners else f"no {self.kind} has it"
        return f"not an option of {self.kind} {name} ({where})"

    def _bare(self, name: str) -> None:
        """Give ``name`` the option model declared for it, else one that takes no options."""
        self._import((self.options_home,) if self.options_home else ())
        if name not in self._models:
            title = "".join(part.title() for part in name.split("_"))
            literal = cast(Any, Literal)[name]  # a Literal of a name known only at run time
            self._models[name] = create_model(f"{title}Options", __base__=Options, type=(literal, name))

    def _find(self, table: Mapping[str, V], name: str, modules: tuple[str, ...]) -> V:
        """``table[name]`` once ``modules`` are imported, else from the entry point ``name``, else :class:`UnknownName`."""
        self._import(modules)
        if name not in table:
            self._load_entry_point(name)
        try:
            return table[name]
        except KeyError:
            raise UnknownName(self.kind, name, self.names(), self.plugins) from None

    def _option_modules(self) -> tuple[str, ...]:
        return (self.options_home,) if self.options_home else self.homes

    @staticmethod
    def _import(modules: tuple[str, ...]) -> None:
        for module in modules:  # cached after the first call
            importlib.import_module(module)

    def _entry_points(self) -> list[importlib.metadata.EntryPoint]:
        return list(importlib.metadata.entry_points(group=self.group))

    def _load_entry_point(self, name: str) -> None:
        """Load the entry point ``name`` of this kind's group, if a package offers one: importing its module usually
        registers the part (its decorator); a plain object is registered under the entry point's name."""
        for ep in self._entry_points():
            if ep.name == name:
                try:
                    part = ep.load()
                except Exception as e:  # ImportError, or whatever the package raises while importing
                    raise ValueError(f"{self.kind} {name!r}: cannot load entry point {ep.value!r} "
                                     f"({type(e).__name__}: {e})") from e
                if name not in self._parts:
                    self.register(name)(part)
                return


ENGINES: Registry[Any] = Registry("engine", *(f"astraflow.rollout.engines.{m}" for m in ("hf", "scripted", "sglang", "vllm")),
                                  options_home="astraflow.rollout.engines.options", plugins="rollout.plugins")
"""Engine factories: ``factory(options, model_cfg, rollout_cfg, tokenizer) -> Engine`` (``rollout/engines/registry.py``)."""
WORKFLOWS: Registry[Any] = Registry("workflow", *(f"astraflow.rollout.workflows.{m}" for m in (
    "single_turn", "tools", "retrieval", "env", "multi_policy", "openai_agent")), options_home="astraflow.rollout.workflows.options",
    plugins="rollout.plugins")
"""Workflow classes: ``cls(reward, options) -> Workflow`` (``rollout/workflows/registry.py``)."""
LOSSES: Registry[Any] = Registry("loss", "astraflow.train.losses.registry", options_home="astraflow.train.losses.options",
                                 plugins="trainer.plugins")
"""Policy loss classes: ``cls(options) -> PolicyLoss`` (``train/losses/registry.py``)."""
BACKENDS: Registry[Any] = Registry("backend", "astraflow.train.backend", plugins="trainer.plugins")
"""Trainer backend factories: ``factory(model, tokenizer, cfg, temperature) -> TrainerBackend`` (``train/backend.py``)."""
SOURCES: Registry[Any] = Registry("source", "astraflow.tasks", plugins="rollout.plugins")
"""Prompt sources: ``source(data_cfg) -> list[Problem]`` (``tasks.py``), by ``data.type``."""
REWARDS: Registry[Any] = Registry("reward", "astraflow.rollout.rewards", plugins="rollout.plugins")
"""Verifiable rewards: ``reward(completion_text, meta) -> float`` (``rollout/rewards``), by ``reward``; read by the nodes
that score and by the dataflow that scores again."""

EngineOptions = Annotated[SerializeAsAny[Options], BeforeValidator(ENGINES.parse)]
WorkflowOptions = Annotated[SerializeAsAny[Options], BeforeValidator(WORKFLOWS.parse)]
LossOptions = Annotated[SerializeAsAny[Options], BeforeValidator(LOSSES.parse)]


def load_plugins(paths: list[str]) -> None:
    """Import each plug-in (a module name, or a ``.py`` file relative to the working directory) so it registers
    what it brings; a plug-in that does not import is a ``ValueError`` saying why."""
    for item in paths:
        try:
            if item.endswith(".py"):
                load_file(Path(item))
            else:
                importlib.import_module(item)
        except Exception as e:  # ImportError, or whatever the plug-in raises while importing
            raise ValueError(f"cannot import {item!r} ({type(e).__name__}: {e})") from e


def load_file(path: Path) -> ModuleType:
    """The Python file at ``path`` imported as a module (once: a second load returns the first)."""
    path = path.resolve()
    name = f"astraflow_plugin_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.exists():
        raise ImportError(f"no Python file at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a fixed file can be loaded again
        raise
    return module
