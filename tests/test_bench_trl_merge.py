"""benchmarks/bench_trl.py --merge: one record over the seeds of several runs, as if they had been one run."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_trl  # noqa: E402
import result_files  # noqa: E402

RECORD = ROOT / "benchmarks" / "results" / "trl_seeds_sft1050.json"  # a committed record over seeds 0 to 4


def write_runs(tmp: Path, parts: dict[str, list[str]], **changes) -> None:
    whole = json.loads(RECORD.read_text())
    for name, seeds in parts.items():
        run = {**whole, "per_seed": {s: whole["per_seed"][s] for s in seeds}, "seeds": [int(s) for s in seeds],
               "command": f"python benchmarks/bench_trl.py --seeds {len(seeds)} ({name})", **changes.get(name, {})}
        (tmp / f"{name}.json").write_text(json.dumps(run))


def test_runs_merged_give_the_figures_of_one_run_over_all_their_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr(result_files, "RESULTS", tmp_path)
    write_runs(tmp_path, {"whole": ["0", "1", "2"], "first": ["0", "1"], "then": ["2"]})
    whole = bench_trl.merge(["whole"], tmp_path / "whole.png", "one")
    parts = bench_trl.merge(["first", "then"], tmp_path / "parts.png", "merged")
    for key in ("sides", "up_over_trl", "second_half_up_minus_trl", "at_times", "ahead_throughout", "per_seed"):
        assert parts[key] == whole[key], key
    assert parts["seeds"] == [0, 1, 2] and len(parts["at_times"]) == bench_trl.GRID
    record = json.loads(RECORD.read_text())["per_seed"]
    for seed, sides in whole["per_seed"].items():  # each seed's figures again from its rows, as its run made them
        for side, made in zip(sides, record[seed]):
            assert side["trained_per_s"] == pytest.approx(made["trained_per_s"], abs=0.2)  # rl_s was kept to 0.1 s
            assert side["held_out_second_half"] == pytest.approx(made["held_out_second_half"], abs=0.01)
            notes = {k for k in made if k.startswith("cpu.")} | {"cores_busy"}  # carried through, not derived
            assert {k: side[k] for k in notes} == {k: made[k] for k in notes}
    written = json.loads((tmp_path / "merged.json").read_text())
    assert written["command"].startswith("python benchmarks/bench_trl.py --seeds 2 (first) && ")  # the runs' own commands
    assert written["command"].endswith("--merge first then --record merged")
    assert [r["seeds"] for r in written["runs"]] == [[0, 1], [2]]
    assert (tmp_path / "parts.png").stat().st_size > 0


def test_a_merge_refuses_a_seed_twice_and_runs_of_another_comparison(tmp_path, monkeypatch):
    monkeypatch.setattr(result_files, "RESULTS", tmp_path)
    write_runs(tmp_path, {"a": ["0", "1"], "b": ["1", "2"], "c": ["2"], "d": ["2"], "e": ["2"]}, c={"sft_steps": 1175},
               d={"cores": 1})
    e = json.loads((tmp_path / "e.json").read_text())
    e["per_seed"]["2"][1]["held_out_v0"] += 0.1  # up's side from another checkpoint
    (tmp_path / "e.json").write_text(json.dumps(e))
    with pytest.raises(SystemExit, match="each seed once"):
        bench_trl.merge(["a", "b"], tmp_path / "x.png", "x")
    with pytest.raises(SystemExit, match="one comparison"):
        bench_trl.merge(["a", "c"], tmp_path / "x.png", "x")
    with pytest.raises(SystemExit, match="one comparison"):  # a run on one core against runs on both
        bench_trl.merge(["a", "d"], tmp_path / "x.png", "x")
    with pytest.raises(SystemExit, match="one checkpoint"):
        bench_trl.merge(["a", "e"], tmp_path / "x.png", "x")
    with pytest.raises(SystemExit, match="no such record"):
        bench_trl.merge(["a", "absent"], tmp_path / "x.png", "x")
    assert not (tmp_path / "x.json").exists()
