"""The shape of the code base: modules, their sizes, the largest classes, and who touches NATS.

    python benchmarks/bench_house.py [PACKAGE_DIR ...]     # default: this checkout's astraflow/

Give several package directories (another checkout's ``astraflow/``) to compare them side by
side. Counts are from the source (ast), not from imports.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

NATS_HANDLES = {"nc", "js", "jsm", "raw", "_nc", "_js", "_jsm", "_raw"}


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
    for path in modules:
        rel = str(path.relative_to(pkg.parent))
        text = path.read_text()
        lines[rel] = len(text.splitlines())
        tree = ast.parse(text)
        in_streams = path.relative_to(pkg).parts[0] == "streams"
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, class_attributes(node), f"{rel}:{node.name}"))
            if in_streams:
                continue
            if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "nats" for a in node.names)) or (
                isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nats" and node.level == 0
            ):
                nats_imports.append(rel)
            elif isinstance(node, ast.Attribute) and node.attr in NATS_HANDLES:
                nats_handles.append(f"{rel}:{node.lineno}")
    biggest = max(classes)
    return {"package": str(pkg), "modules": len(modules), "lines": sum(lines.values()),
            "largest_module": max(lines.items(), key=lambda kv: kv[1]), "modules_over_500_lines": sum(v > 500 for v in lines.values()),
            "largest_class": {"name": biggest[2], "lines": biggest[0], "attributes": biggest[1]},
            "most_attributes": max(((a, n) for _, a, n in classes)),
            "nats_imports_outside_streams": len(nats_imports), "nats_handle_uses_outside_streams": len(nats_handles)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packages", nargs="*", type=Path, help="package directories to compare (default: this checkout's astraflow/)")
    pkgs = ap.parse_args().packages or [Path(__file__).resolve().parent.parent / "astraflow"]
    if missing := [str(p) for p in pkgs if not p.is_dir()]:
        ap.error(f"not a directory: {', '.join(missing)}")
    rows = [survey(p) for p in pkgs]
    t = Table(title="the house")
    t.add_column("figure")
    for r in rows:
        t.add_column(str(r["package"]))
    for key in ("modules", "lines", "largest_module", "modules_over_500_lines", "largest_class", "most_attributes",
                "nats_imports_outside_streams", "nats_handle_uses_outside_streams"):
        t.add_row(key, *(json.dumps(r[key]) for r in rows))
    Console().print(t)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
