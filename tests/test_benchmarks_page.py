"""BENCHMARKS.md's rendered sections are what ``benchmarks/render.py`` makes of the committed results files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import render  # noqa: E402


def test_every_rendered_section_matches_its_results_file():
    page = render.PAGE.read_text()
    names = [m["name"] for m in render.SECTION.finditer(page)]
    assert names, "BENCHMARKS.md has no rendered section"
    assert render.render(page) == page, "BENCHMARKS.md is stale: run python benchmarks/render.py"
    for name in names:
        record = json.loads((render.RESULTS / f"{name}.json").read_text())
        assert {"command", "machine", "date", "commit"} <= set(record), f"{name}.json lacks its provenance"


def test_a_changed_figure_shows_on_the_page(tmp_path, monkeypatch):
    page = render.PAGE.read_text()
    name = next(render.SECTION.finditer(page))["name"]
    record = json.loads((render.RESULTS / f"{name}.json").read_text())
    record["date"] = "1999-01-01"
    (tmp_path / f"{name}.json").write_text(json.dumps(record))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    for other in render.SECTION.finditer(page):
        if other["name"] != name:
            (tmp_path / f"{other['name']}.json").write_text((ROOT / "benchmarks" / "results" / f"{other['name']}.json").read_text())
    fresh = render.render(page)
    assert fresh != page and "1999-01-01" in fresh
