"""Everything the project's Python imports is installed by its own declared install (README: ``pip install torch==2.13.0
-e '.[test]'``): each module under ``astraflow/``, ``benchmarks/`` and ``examples/`` imports in this environment, and
every package named by an import anywhere in them, a lazy one inside a function included, can be found. A package that
only an optional extra installs (a serving engine, say) must be declared under that extra."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("astraflow", "benchmarks", "examples")
# imported only where the user asked for that engine (or runs that peer); each must be the name of a declared extra of
# pyproject.toml
OPTIONAL = {"vllm": "vllm", "sglang": "sglang", "trl": "trl", "datasets": "trl"}


def python_files() -> list[Path]:
    return sorted(p for d in SOURCES for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path``, at any depth of the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def local_names() -> set[str]:
    """Modules the scripts import from their own folder (``from stats import …``) or from tests/."""
    return {p.stem for d in (*SOURCES, "tests") for p in (ROOT / d).rglob("*.py")}


def test_every_imported_package_is_installed_or_a_declared_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    missing, undeclared = [], []
    for path in python_files():
        for name in sorted(imported_packages(path) - local_names() - set(sys.stdlib_module_names)):
            if name in OPTIONAL:
                if OPTIONAL[name] not in extras:
                    undeclared.append(f"{path.relative_to(ROOT)}: {name} (extra {OPTIONAL[name]!r} is not declared)")
            elif find_spec(name) is None:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not undeclared, "optional imports whose extra pyproject.toml lacks:\n" + "\n".join(undeclared)
    assert not missing, "imported but not installed by `pip install -e '.[test]'` (declare them in pyproject.toml):\n" + "\n".join(missing)


# Imports each file in a fresh interpreter, as the user would run it: a package module by its dotted name, a script
# with its own folder first on sys.path (as `python benchmarks/x.py` has it). Prints the failures as JSON.
IMPORT_ALL = """
import importlib, importlib.util, json, sys, traceback
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
root, failures = Path(sys.argv[1]), {}
for rel in sys.argv[2:]:
    path = root / rel
    try:
        if rel.startswith("astraflow/"):
            importlib.import_module(".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"))
        else:
            sys.path.insert(0, str(path.parent))
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module
            spec.loader.exec_module(module)
    except BaseException as e:
        failures[rel] = "".join(traceback.format_exception_only(type(e), e)).strip()
print(json.dumps(failures))
"""


def test_every_module_imports(tmp_path: Path):
    files = [str(p.relative_to(ROOT)) for p in python_files()]
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(ROOT), *files], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failures, "modules that fail to import here:\n" + "\n".join(f"{k}: {v}" for k, v in failures.items())


def test_the_launcher_and_the_dataflow_start_without_the_model_stack():
    """``astraflow up`` prepares a CPU run, and the dataflow loads ByT5 and serves, without importing torch: on a 2-core
    machine its import is seconds of CPU before any role starts, and again at every restart of the plane's roles."""
    script = (
        "import sys\n"
        "from astraflow.config import load_recipe\n"
        "from astraflow.launch.up import trains_on_accelerator\n"
        "from astraflow.rollout.eval_plan import eval_subjects, eval_versions\n"
        "import astraflow.dataflow.service\n"
        "from astraflow.models import decode_text, encode_prompt, load_tokenizer\n"
        "recipe = load_recipe('recipes/arithmetic/inprocess.yaml')\n"
        "assert not trains_on_accelerator(recipe.model_copy(update={'policies': {p: c.model_copy(update={'trainer': "
        "c.trainer.model_copy(update={'device': 'cpu'})}) for p, c in recipe.policies.items()}}))\n"
        "assert eval_versions(recipe)[0] == 0 and eval_subjects(recipe) == ('solver',)\n"
        "tok = load_tokenizer('byt5')\n"
        "assert decode_text(tok, encode_prompt(tok, '12+34=')) == '12+34='\n"
        "print(sorted(m for m in ('torch', 'transformers.modeling_utils') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"the model stack was imported: {out.stdout}"
