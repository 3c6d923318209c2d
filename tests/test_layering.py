"""The house rules, checked on the source: ``streams/`` is the only door to NATS, and the packages
keep their dependency direction (``docs/architecture.md``, "Dependency direction")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "astraflow"
NATS_HANDLES = {"_nc", "_js", "_jsm", "_raw", "_sub", "nc", "js", "jsm", "raw"}  # what a Plane or Delivery wraps


def modules(under: str = "") -> list[Path]:
    return sorted(p for p in (PKG / under).rglob("*.py") if "__pycache__" not in p.parts)


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(PKG.parent))


@pytest.mark.parametrize("path", [p for p in modules() if "streams" not in p.relative_to(PKG).parts[:1]], ids=rel)
def test_only_streams_touches_nats(path: Path):
    nats = sorted(m for m in imports(path) if m == "nats" or m.startswith("nats."))
    assert not nats, f"{rel(path)} imports {nats}: go through astraflow.streams (Plane, Delivery, RunState, ObjectStore)"
    handles = sorted({f"{ast.unparse(n.value)}.{n.attr}" for n in ast.walk(ast.parse(path.read_text()))
                      if isinstance(n, ast.Attribute) and n.attr in NATS_HANDLES})
    assert not handles, f"{rel(path)} reaches through the plane to NATS objects: {handles}"


# a stream, a consumer or a stream sequence by name: the flows' ports (streams/task_queue.py, trajectory_log.py,
# batch_queue.py, weight_channel.py) speak of tasks, tickets, marks, backlogs and positions instead
STREAM_NAMES = {"task_stream", "traj_stream", "batch_stream", "weights_stream", "dlq_stream", "pool_consumer", "trainer_consumer",
                "DATAFLOW_CONSUMER", "stream_seq"}
PLANE_BY_STREAM = {"stored", "consumer", "trajectory_consumer", "lag", "consumer_settings", "stream_msgs", "last", "last_seq",
                   "stream_last", "holds", "get", "delete", "get_many", "read_many", "read_stored", "held",
                   "on_max_deliveries", "remake_consumer"}


@pytest.mark.parametrize("path", [p for p in modules() if "streams" not in p.relative_to(PKG).parts[:1]], ids=rel)
def test_only_streams_names_streams_consumers_and_sequences(path: Path):
    named = sorted({f"{ast.unparse(n.value)}.{n.attr}" for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.Attribute) and (n.attr in STREAM_NAMES or (
                        n.attr in PLANE_BY_STREAM and ast.unparse(n.value).split(".")[-1] in ("plane", "_plane")))})
    assert not named, f"{rel(path)} reasons in streams, consumers or sequences: {named}; use a flow's port in astraflow.streams"


ROLE_PACKAGES = ("dataflow", "rollout", "train")


@pytest.mark.parametrize("package", ROLE_PACKAGES)
def test_roles_never_import_each_other(package: str):
    others = [f"astraflow.{p}" for p in ROLE_PACKAGES if p != package]
    for path in modules(package):
        bad = sorted(m for m in imports(path) if any(m == o or m.startswith(o + ".") for o in others))
        assert not bad, f"{rel(path)} imports {bad}: roles meet only on the plane"


@pytest.mark.parametrize("path", modules("algorithms") + [PKG / "weights" / "delta.py"], ids=rel)
def test_pure_parts_import_nothing_with_io(path: Path):
    ours = sorted(m for m in imports(path) if m.startswith("astraflow.") and not m.startswith("astraflow.algorithms")
                  and m != "astraflow.registry")  # the registry imports plug-ins by name, nothing with I/O
    assert not ours, f"{rel(path)} is pure but imports {ours}"


@pytest.mark.parametrize("name", ["config.py", "registry.py"])
def test_config_does_not_pull_in_a_role(name: str):
    bad = sorted(m for m in imports(PKG / name) if m.startswith(tuple(f"astraflow.{p}" for p in ROLE_PACKAGES)))
    assert not bad, f"{name} imports {bad}: every role would import that package"


OPTION_MODULES = ["rollout/engines/options.py", "rollout/workflows/options.py", "train/losses/options.py"]
LIGHT = {"__future__", "typing", "pydantic", "astraflow.registry"}


@pytest.mark.parametrize("module", OPTION_MODULES)
def test_option_models_are_light(module: str):
    """Every role validates a recipe against these (``registry`` imports them by name): pydantic only, and the
    packages they sit in import nothing either."""
    from astraflow import registry

    assert f"astraflow.{module[:-3].replace('/', '.')}" in {r.options_home for r in (registry.ENGINES, registry.WORKFLOWS,
                                                                                      registry.LOSSES)}
    heavy = sorted(imports(PKG / module) - LIGHT)
    assert not heavy, f"{module} imports {heavy}: loading a recipe would import them in every role"
    parts = module.split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        init = PKG.joinpath(*parts[:depth], "__init__.py")
        assert not imports(init), f"{rel(init)} imports {sorted(imports(init))}: importing the option models runs it"
