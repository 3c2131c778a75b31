"""Failures named on every rank: the watchdog, its fault board and its reports.

See ``docs/reliability.md``. The wrapper starts the watchdog (``watch``) and marks its
progress (``progress.PROGRESS``); the Lightning strategy reports the exceptions that end
training (``current().report_exception``) and hands over the processes it launched.
"""

from .monitor import Watchdog, adopt_children, current, release, watch
from .progress import PROGRESS
from .report import RankFailedError, RankStalledError

__all__ = [
    "PROGRESS",
    "RankFailedError",
    "RankStalledError",
    "Watchdog",
    "adopt_children",
    "current",
    "release",
    "watch",
]
