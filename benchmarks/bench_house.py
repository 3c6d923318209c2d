"""The shape of the code base: modules, their sizes, the largest classes and functions, who touches NATS, who names
the plane's streams, consumers and sequences outside ``streams/``, protocol values typed as strings, and plug-in
mechanisms.

    python benchmarks/bench_house.py [PACKAGE_DIR ...]     # default: this checkout's astraflow/
    python benchmarks/bench_house.py --against COMMIT       # that commit's astraflow/ beside this checkout's

Give several package directories (another checkout's ``astraflow/``), or a commit of this repository, to compare
them side by side. Counts are from the source (ast), not from imports.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

import result_files
from rich.console import Console
from rich.table import Table

NATS_HANDLES = {"nc", "js", "jsm", "raw", "_nc", "_js", "_jsm", "_raw"}
# what a role names when it reasons in JetStream terms: a stream, a consumer or a sequence by name, or the plane asked
# by stream and sequence (the rule of tests/test_layering.py, plus sequence bookkeeping: ``seqs``)
STREAM_NAMES = {"task_stream", "traj_stream", "batch_stream", "weights_stream", "dlq_stream", "object_stream", "pool_consumer",
                "trainer_consumer", "DATAFLOW_CONSUMER", "stream_seq", "seqs"}
PLANE_BY_STREAM = {"stored", "consumer", "trajectory_consumer", "lag", "consumer_settings", "stream_msgs", "last", "last_seq",
                   "stream_last", "holds", "get", "delete", "get_many", "read_many", "read_stored", "held",
                   "on_max_deliveries", "remake_consumer"}


def names_the_plane(node: ast.Attribute) -> bool:
    return node.attr in STREAM_NAMES or (node.attr in PLANE_BY_STREAM and ast.unparse(node.value).split(".")[-1] in ("plane", "_plane"))


FATE_TEXT = re.compile(r"^(filtered|dropped|failed|invalid):[a-z_]*$")  # a fate written as a string literal ("failed:lost")
OP_NAMES = {"step", "state", "retune", "save", "snapshot", "load", "load_weights", "stop"}  # trainer operations by name


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def string_protocol(tree: ast.AST) -> list[int]:
    """Lines where a protocol value travels as a string: a fate literal, a reason split at ':', an operation by name."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and FATE_TEXT.match(n.value):
            out.append(n.lineno)
        elif isinstance(n, ast.JoinedStr) and n.values and isinstance(n.values[0], ast.Constant) \
                and FATE_TEXT.match(str(n.values[0].value)):
            out.append(n.lineno)  # f"failed:{reason}"
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("split", "startswith") \
                and n.args and isinstance(n.args[0], (ast.Constant, ast.Tuple)) and ":" in ast.unparse(n.args[0]):
            out.append(n.lineno)  # reason.split(":"), fate.startswith(("failed:", ...))
        elif isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant) and n.args[0].value in OP_NAMES \
                and isinstance(n.func, ast.Name) and n.func.id == "run_op":
            out.append(n.lineno)  # run_op("step", batch)
    return out


def plugin_mechanisms(tree: ast.AST) -> set[str]:
    """Ways a part is looked up by name: a class with a ``register`` method (a registry, however many instances),
    a ``register*`` function, an upper-case dict from name strings to parts, a ``"module:attr"`` string."""
    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef) and n.col_offset == 0 and any(
                isinstance(f, ast.FunctionDef) and f.name == "register" for f in n.body):
            found.add(f"class {n.name}")
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("register") and n.col_offset == 0:
            found.add(f"def {n.name}")
        elif isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, ast.Dict) and n.col_offset == 0:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names = [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]
            values = [v for v in n.value.values if v is not None]
            keys_are_names = all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in n.value.keys)
            if names and values and keys_are_names and all(isinstance(v, (ast.Name, ast.Attribute)) for v in values):
                found.add(f"dict {names[0]}")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("partition", "rsplit", "split") \
                and n.args and isinstance(n.args[0], ast.Constant) and n.args[0].value == ":" \
                and "module" in ast.unparse(n.func.value).lower():
            found.add("'module:attr' strings")
    return found


def class_attributes(node: ast.ClassDef) -> int:
    """Instance attributes assigned anywhere in the class (``self.x = ...``)."""
    names = set()
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return len(names)


def survey(pkg: Path) -> dict[str, object]:
    modules = sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)
    lines, classes, nats_imports, nats_handles = {}, [], [], []
    funcs: list[tuple[int, str]] = []
    plane_terms: list[str] = []
    strings: list[str] = []
    mechanisms: dict[str, str] = {}
    for path in modules:
        rel = str(path.relative_to(pkg.parent))
        text = path.read_text()
        lines[rel] = len(text.splitlines())
        tree = ast.parse(text)
        in_streams = path.relative_to(pkg).parts[0] == "streams"
        funcs += [(f.end_lineno - f.lineno + 1, f"{rel}:{f.name}") for f in functions(tree)]  # type: ignore[operator]
        strings += [f"{rel}:{line}" for line in string_protocol(tree)]
        mechanisms.update({m: rel for m in plugin_mechanisms(tree)})
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append(((node.end_lineno or node.lineno) - node.lineno + 1, class_attributes(node), f"{rel}:{node.name}"))
            if in_streams:
                continue
            if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "nats" for a in node.names)) or (
                isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nats" and node.level == 0
            ):
                nats_imports.append(rel)
            elif isinstance(node, ast.Attribute) and node.attr in NATS_HANDLES:
                nats_handles.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Attribute) and names_the_plane(node):
                plane_terms.append(f"{rel}:{node.lineno}")
    biggest = max(classes)
    return {"package": str(pkg), "modules": len(modules), "lines": sum(lines.values()),
            "largest_module": max(lines.items(), key=lambda kv: kv[1]), "modules_over_500_lines": sum(v > 500 for v in lines.values()),
            "largest_class": {"name": biggest[2], "lines": biggest[0], "attributes": biggest[1]},
            "most_attributes": max(((a, n) for _, a, n in classes)),
            "classes_over_200_lines": sum(n > 200 for n, _, _ in classes),
            "largest_function": {"name": max(funcs)[1], "lines": max(funcs)[0]}, "functions_over_60_lines": sum(n > 60 for n, _ in funcs),
            "nats_imports_outside_streams": len(nats_imports), "nats_handle_uses_outside_streams": len(nats_handles),
            "stream_consumer_sequence_names_outside_streams": len(plane_terms), "string_typed_protocol_values": len(strings),
            "plugin_mechanisms": sorted(mechanisms)}


FIGURES = ("modules", "lines", "largest_module", "modules_over_500_lines", "largest_class", "most_attributes",
           "classes_over_200_lines", "largest_function", "functions_over_60_lines", "nats_imports_outside_streams",
           "nats_handle_uses_outside_streams", "stream_consumer_sequence_names_outside_streams", "string_typed_protocol_values",
           "plugin_mechanisms")


def cell(value: object) -> str:
    """A figure as a short table cell (the JSON line after the table has it whole)."""
    if isinstance(value, dict) and "name" in value:
        extra = f", {value['attributes']} attributes" if "attributes" in value else ""
        return f"{str(value['name']).removeprefix('astraflow/')} ({value['lines']} lines{extra})"
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[1], (int, str)) and not isinstance(value[0], str):
        return f"{value[0]} ({str(value[1]).removeprefix('astraflow/')})"
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str):
        return f"{value[0].removeprefix('astraflow/')} ({value[1]})"
    if isinstance(value, list):
        return f"{len(value)}: " + ", ".join(map(str, value))
    return str(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packages", nargs="*", type=Path, help="package directories to compare (default: this checkout's astraflow/)")
    ap.add_argument("--labels", nargs="*", help="a column name per package (a commit, 'before'); default: the paths")
    ap.add_argument("--against", metavar="COMMIT", help="a commit of this repository: its astraflow/ in the first column")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/house.json")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    pkgs = args.packages or [root / "astraflow"]
    labels = args.labels or [str(p) for p in pkgs]
    scratch = tempfile.TemporaryDirectory()
    if args.against:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", args.against], capture_output=True, text=True,
                             check=True).stdout.strip()
        tree = subprocess.run(["git", "-C", str(root), "archive", sha, "astraflow"], capture_output=True, check=True).stdout
        tarfile.open(fileobj=io.BytesIO(tree)).extractall(scratch.name, filter="data")
        pkgs, labels = [Path(scratch.name) / "astraflow", *pkgs], [sha, *(["this checkout"] if not args.labels else labels)]
    if len(labels) != len(pkgs):
        ap.error(f"{len(labels)} labels for {len(pkgs)} packages")
    if missing := [str(p) for p in pkgs if not p.is_dir()]:
        ap.error(f"not a directory: {', '.join(missing)}")
    rows = [survey(p) for p in pkgs]
    t = Table(title="the house")
    t.add_column("figure")
    for label in labels:
        t.add_column(label)
    for key in FIGURES:
        t.add_row(key.replace("_", " "), *(cell(r[key]) for r in rows))
    Console().print(t)
    for r, label in zip(rows, labels, strict=True):
        r["package"] = label
    result_files.write("house", {"trees": rows}, args.out)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
