"""User plug-ins: ``type: plugin`` with ``path: "package.module:ClassName"`` and ``params``.

The class is imported when the config is validated, so a typo in the path, a class of the
wrong hook kind or a parameter its constructor does not take fails at config load, with the
config location in the error. The pipeline then builds it as ``ClassName(**params)``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, ClassVar, Literal, TypeAlias

from pydantic import Field, ValidationInfo, field_validator

from astraflow.algorithms.base import Advantage, AlgoConfig, Curator, Filter, Plugin, Server

PluginClass: TypeAlias = type[Plugin]  # an alias: inside the configs below, ``type`` is a field


def load_class(path: str, hook: type[Plugin]) -> type[Plugin]:
    """Import ``"module:Class"`` and check it is a ``hook`` subclass; errors say what to fix."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"plugin path {path!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while importing
        raise ValueError(
            f"plugin path {path!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
            "is it installed or on PYTHONPATH?"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"plugin path {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not (isinstance(obj, type) and issubclass(obj, hook)):
        raise ValueError(
            f"plugin path {path!r}: {obj!r} is not a subclass of astraflow.algorithms.{hook.__name__}; "
            f"a {hook.__name__.lower()} plug-in must subclass it"
        )
    return obj


class PluginConfig(AlgoConfig):
    """A user plug-in class, imported by path and built as ``Class(**params)``."""

    hook: ClassVar[PluginClass] = Plugin

    type: Literal["plugin"] = "plugin"
    path: str
    """Where the class lives, as ``"package.module:ClassName"``."""
    params: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    """Keyword arguments for the class's constructor."""

    @field_validator("path")
    @classmethod
    def _import(cls, path: str) -> str:
        load_class(path, cls.hook)
        return path

    @field_validator("params")
    @classmethod
    def _bind(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        path = info.data.get("path")
        if path is None:  # the path itself failed; that error is reported
            return params
        try:
            signature = inspect.signature(load_class(path, cls.hook))
        except ValueError:  # no introspectable signature (a C extension): checked when built
            return params
        try:
            signature.bind(**params)
        except TypeError as exc:
            raise ValueError(f"{path} does not accept params {sorted(params)}: {exc}") from None
        return params

    def build(self) -> Plugin:
        return load_class(self.path, self.hook)(**self.params)


class CuratorPlugin(PluginConfig):
    hook: ClassVar[PluginClass] = Curator


class FilterPlugin(PluginConfig):
    hook: ClassVar[PluginClass] = Filter


class ServerPlugin(PluginConfig):
    hook: ClassVar[PluginClass] = Server


class AdvantagePlugin(PluginConfig):
    hook: ClassVar[PluginClass] = Advantage
