"""benchmarks/bench_ratio_plot.py: one report drawn as it is, several pooled first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The script draws with matplotlib, one of the dev tools (pyproject.toml's dev extra).
pytest.importorskip("matplotlib", reason="the dev extra's matplotlib is not installed")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ratio_plot.py"
CONFIG = {"steps": 8, "warmup": 2, "batch_size": None, "rounds": 2}


def _report(ratios: list[float], hook_ratios: list[float]) -> dict[str, object]:
    entry = {
        "round_ratios": ratios,
        "ratio_of_medians": sum(ratios) / len(ratios),
        "median_round_ratio": sorted(ratios)[len(ratios) // 2],
        "round_ratio_ci95": [min(ratios), max(ratios)],
        "hooks": {
            "fp16": {
                "round_ratios": hook_ratios,
                "median_round_ratio": sorted(hook_ratios)[len(hook_ratios) // 2],
                "round_ratio_ci95": [min(hook_ratios), max(hook_ratios)],
            }
        },
    }
    return {"config": CONFIG, "world_size_2": {"tiny_mlp": entry}}


def _draw(tmp_path: Path, *reports: dict[str, object]) -> subprocess.CompletedProcess[str]:
    paths = []
    for k, report in enumerate(reports):
        path = tmp_path / f"run{k}.json"
        path.write_text(json.dumps(report))
        paths.append(str(path))
    out = tmp_path / "ratios.png"
    cmd = [sys.executable, str(SCRIPT), *paths, "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_several_reports_are_pooled_into_one_picture(tmp_path: Path) -> None:
    done = _draw(tmp_path, _report([0.9, 1.0], [1.1, 1.2]), _report([1.0, 1.1], [1.3, 1.4]))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ratios.png").stat().st_size > 1000


def test_paired_step_ratios_are_drawn_where_the_reports_have_them(tmp_path: Path) -> None:
    old = _draw(tmp_path, _report([0.9, 1.0], [1.1, 1.2]))
    assert old.returncode == 0 and "(round ratios)" in old.stdout, old.stderr
    report = _report([0.9, 1.0], [1.1, 1.2])
    entry = report["world_size_2"]["tiny_mlp"]  # type: ignore[index]
    entry["paired_steps"] = {"median": 0.95, "ci95": [0.9, 1.0], "n": 16}
    entry["hooks"]["fp16"]["paired_steps"] = {"median": 1.05, "ci95": [1.0, 1.1], "n": 16}
    new = _draw(tmp_path, report)
    assert new.returncode == 0 and "(paired step ratios)" in new.stdout, new.stderr


def test_reports_made_with_other_options_are_refused(tmp_path: Path) -> None:
    other = _report([1.0, 1.1], [1.3, 1.4])
    other["config"] = {**CONFIG, "steps": 3}
    done = _draw(tmp_path, _report([0.9, 1.0], [1.1, 1.2]), other)
    assert done.returncode == 2
    assert "steps is 3" in done.stderr
    assert not (tmp_path / "ratios.png").exists()
