"""Open unions: option models picked by ``type:`` from registries that plug-ins extend.

Data algorithms pick their config from a closed pydantic union (``algorithms/config.py``).
Engines, workflows and losses stay open: a module named in ``rollout.plugins`` or
``trainer.plugins`` registers its own. So each of these kinds has a registry of option models
keyed by ``type``, and the recipe field of that kind resolves its model from the registry while
the recipe is validated:

    workflow: {type: multi_turn_tools, max_turns: 3, tools: [bm25]}
    rollout: {engine: {type: scripted, latency: pareto, latency_alpha: 1.2}}
    trainer: {loss: {type: m2po, tau: 0.004}}

An unknown ``type`` fails at load and names the registered ones. A field the chosen model does
not have also fails at load, with its location and where it belongs (``rollout.engine.latency_sigma:
not an option of engine hf (it is an option of scripted)``). A bare name (``engine: hf``) means
``{type: hf}``.

Built-in option models live beside their implementations, in light modules that import only
pydantic. Each registry names that module (``home``) and imports it on first use. So neither
this module nor ``config`` imports a role package, and loading a recipe imports no torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import BaseModel, BeforeValidator, ConfigDict, SerializeAsAny, ValidationError, create_model
from pydantic_core import PydanticCustomError


class Options(BaseModel):
    """Base of every option model: ``type`` names the implementation, and unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    type: str


M = TypeVar("M", bound=type[Options])


def type_name(model: type[Options]) -> str:
    """The ``type`` an option model stands for: the default of its ``type`` field (``type: Literal["hf"] = "hf"``)."""
    name = model.model_fields["type"].default
    if not isinstance(name, str):
        raise TypeError(f"{model.__name__} must declare its name as the default of type: type: Literal['name'] = 'name'")
    return name


class OptionRegistry:
    """Option models of one kind (engine, workflow, loss) by ``type``; ``parse`` is the recipe field's validator."""

    def __init__(self, kind: str, home: str, plugins: str) -> None:
        self.kind = kind  # what messages call a member: "engine"
        self.home = home  # the module that registers the built-in option models
        self.plugins = plugins  # where a recipe lists the modules that register more
        self._models: dict[str, type[Options]] = {}

    def register(self, model: M) -> M:
        """Register ``model`` under its ``type`` (a later registration of the same name replaces it)."""
        self._models[type_name(model)] = model
        return model

    def ensure(self, name: str) -> type[Options]:
        """The option model registered for ``name``; a bare one (``type`` only) is registered if there is none."""
        importlib.import_module(self.home)
        if name not in self._models:
            title = "".join(part.title() for part in name.split("_"))
            literal = cast(Any, Literal)[name]  # a Literal of a name known only at run time
            self.register(create_model(f"{title}Options", __base__=Options, type=(literal, name)))
        return self._models[name]

    def get(self, name: str) -> type[Options]:
        importlib.import_module(self.home)
        try:
            return self._models[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._models))} "
                             f"(a plug-in module listed in {self.plugins} registers more)") from None

    def names(self) -> list[str]:
        importlib.import_module(self.home)
        return sorted(self._models)

    def parse(self, value: Any) -> Any:
        """A name or a mapping with ``type`` -> that type's option model, validated (its errors keep their location)."""
        if isinstance(value, Options):
            if self._models.get(value.type) is type(value):
                return value
            value = value.model_dump()  # an option model of another kind, or replaced since: checked afresh
        if isinstance(value, str):
            value = {"type": value}
        if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
            raise ValueError(f"the {self.kind} must be a name or a mapping with a type ({{type: name, ...}}); "
                             f"registered: {', '.join(self.names())}")
        model = self.get(value["type"])
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


ENGINE_OPTIONS = OptionRegistry("engine", "astraflow.rollout.engines.options", "rollout.plugins")
WORKFLOW_OPTIONS = OptionRegistry("workflow", "astraflow.rollout.workflows.options", "rollout.plugins")
LOSS_OPTIONS = OptionRegistry("loss", "astraflow.train.losses.options", "trainer.plugins")

EngineOptions = Annotated[SerializeAsAny[Options], BeforeValidator(ENGINE_OPTIONS.parse)]
WorkflowOptions = Annotated[SerializeAsAny[Options], BeforeValidator(WORKFLOW_OPTIONS.parse)]
LossOptions = Annotated[SerializeAsAny[Options], BeforeValidator(LOSS_OPTIONS.parse)]


def load_plugins(paths: list[str]) -> None:
    """Import each plug-in (a module name, or a ``.py`` file relative to the working directory) so it registers
    what it brings; a plug-in that does not import is a ``ValueError`` saying why."""
    for item in paths:
        try:
            if item.endswith(".py"):
                _load_file(Path(item).resolve())
            else:
                importlib.import_module(item)
        except Exception as e:  # ImportError, or whatever the plug-in raises while importing
            raise ValueError(f"cannot import {item!r} ({type(e).__name__}: {e})") from e


def _load_file(path: Path) -> None:
    name = f"astraflow_plugin_{path.stem}"
    if name in sys.modules:
        return
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
