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

The tests marked ``jobs`` (whole programs: torchrun jobs killed, signalled and restarted,
``fabric run``, the benchmark script, the fork guard's thousands of forks) are left out of
a run of the whole suite with no ``-m``: that is ``python3 dev.py test``, the quick tier.
``python3 dev.py test -m jobs`` runs them alone, ``--all`` runs everything, and naming a
file or folder, or choosing with ``-k``, runs what is in it or matches. CI runs both tiers
(.ci/run).
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        help="also run the tests marked jobs, which a run of the whole suite leaves out",
    )


def _quick_tier(config: pytest.Config) -> bool:
    """Whether this run leaves the ``jobs`` tests out: the whole suite, and no ``-m``,
    ``-k`` or ``--all``."""
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    chosen = config.option.markexpr or config.option.keyword or config.getoption("--all")
    return whole and not chosen


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped = [], []
    quick = _quick_tier(config)
    for item in items:
        marker = item.get_closest_marker("compat")
        if marker is not None:
            _AREAS[item.nodeid] = marker.args[0]
        other_area = _ONLY_AREAS and (marker is None or marker.args[0] not in _ONLY_AREAS)
        if other_area or (quick and item.get_closest_marker("jobs") is not None):
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


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    if _quick_tier(config):
        terminalreporter.write_line(
            "the tests marked jobs were left out: `python3 dev.py test -m jobs` runs them "
            "(about 15 minutes), `--all` everything"
        )
