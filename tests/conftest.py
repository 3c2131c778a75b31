"""The suite's rank processes start with torch._dynamo imported.

A process imports torch._dynamo the first time it builds an optimizer (torch.optim's
methods are wrapped to keep Dynamo out of them): one to several seconds of CPU per rank,
paid again in nearly every launch of ``run_ranks``. The forkserver the ranks come from
imports it once instead (``MULTIRANK_PRELOAD``, read when multirank is
imported: set here, before any test module imports it). The benchmark runs the suite starts
inherit it; run by hand, the benchmarks leave it out, so their ranks stay as fresh as a
user's. test_compile.py's check that eager training never imports torch._dynamo starts its
rank fresh (``run_ranks(..., fresh=True)``).

It also reports the outcomes of the tests marked ``compat`` by area, for ``python3 dev.py
compat``, when BUCKETDDP_COMPAT_REPORT names a file.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ["MULTIRANK_PRELOAD"] = "torch._dynamo"


# ``python3 dev.py compat`` (tools/compat.py) reads each area's outcomes from this file.
# BUCKETDDP_COMPAT_AREAS (comma separated) keeps only those areas' compat tests.
_COMPAT_REPORT = os.environ.get("BUCKETDDP_COMPAT_REPORT")
_ONLY_AREAS = {a for a in os.environ.get("BUCKETDDP_COMPAT_AREAS", "").split(",") if a}
_AREAS: dict[str, str] = {}
_OUTCOMES: dict[str, str] = {}


@pytest.fixture
def shm() -> Iterator[Path]:
    """A folder in /dev/shm (not made yet) for a test's snapshots, removed after the test."""
    path = Path("/dev/shm") / f"bucketddp-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("compat")
        if marker is not None:
            _AREAS[item.nodeid] = marker.args[0]
        if _ONLY_AREAS and (marker is None or marker.args[0] not in _ONLY_AREAS):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # A test's outcome is its call's, unless its setup or teardown failed or skipped it.
    counts = report.when == "call" or report.outcome != "passed"
    if counts and report.nodeid in _AREAS and _OUTCOMES.get(report.nodeid) != "failed":
        _OUTCOMES[report.nodeid] = report.outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _COMPAT_REPORT:
        return
    by_area: dict[str, list[str]] = {}
    for nodeid, area in _AREAS.items():
        if nodeid in _OUTCOMES:
            by_area.setdefault(area, []).append(_OUTCOMES[nodeid])
    with open(_COMPAT_REPORT, "w") as out:
        json.dump(by_area, out)
