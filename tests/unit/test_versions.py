"""The version-bounds policy (docs/compatibility.md#version-bounds): floors only in the
metadata, the tested window in bucketddp.versions, a warning outside it."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from bucketddp.versions import TESTED, UntestedVersionWarning, warn_if_untested

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")  # Python 3.11 and newer


def test_the_metadata_states_floors_only() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = [*project["dependencies"], *project["optional-dependencies"]["lightning"]]
    capped = [spec for spec in runtime if "<" in spec or "==" in spec or "~=" in spec]
    assert not capped, capped
    floors = {re.split(r"[>=<]", s)[0]: s.split(">=")[1] for s in runtime if ">=" in s}
    assert floors["torch"] == TESTED["torch"][0]
    assert floors["lightning"] == TESTED["lightning"][0]


def test_the_tested_window_is_the_compatibility_tables() -> None:
    page = (ROOT / "docs" / "compatibility.md").read_text()
    rows = re.findall(r"^\| 3\.\d+ \| (\d+\.\d+)\.\d+ \| (\d+\.\d+)\.\d+ \|", page, flags=re.M)
    key = lambda v: tuple(map(int, v.split(".")))  # noqa: E731
    torch_minors = sorted({t for t, _ in rows}, key=key)
    lightning_minors = sorted({lt for _, lt in rows}, key=key)
    assert (torch_minors[0], torch_minors[-1]) == TESTED["torch"]
    assert (lightning_minors[0], lightning_minors[-1]) == TESTED["lightning"]


@pytest.mark.parametrize(
    ("package", "version", "warns"),
    [
        ("torch", "2.15.0+cpu", False),
        ("torch", "2.16.0", True),
        ("torch", "3.0.0a0", True),
        ("torch", "2.5.1", False),
        ("lightning", "2.6.6", False),
        ("lightning", "2.7.0", True),
    ],
)
def test_a_release_newer_than_the_window_warns(package: str, version: str, warns: bool) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_untested(package, version)
    assert [w.category for w in caught] == ([UntestedVersionWarning] if warns else [])
