"""A stop notice: a signal on any rank stops every rank at the same step boundary.

A preemption (Kubernetes, SLURM, a spot instance) sends a signal first: SIGTERM, or the
one SLURM's ``--signal`` names. Elastic training installs ``NOTICE``'s handler for the
signals ``stop_signals()`` names while it trains. The handler only sets a flag: it runs on
whichever rank got the signal, between two bytecodes of the main thread, so it never
starts a collective.

The flag travels in a collective the step already makes: the reducer's agreement row
(``reducer/agreement.py``) has one slot for it, in the last bucket's all-reduce. A rank
whose flag is set writes 1 there; after the all-reduce every rank reads the same sum, so
every rank learns of the notice in the same step (``agreed``). At that step's boundary the
elastic layer takes a snapshot of exactly that step and raises ``Preempted`` on every rank;
torchrun's restart resumes from it with no step done twice. A step with no notice costs
nothing more: the row's sum is compared as before.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

ENV = "BUCKETDDP_STOP_SIGNALS"
DEFAULT = "SIGTERM,SIGUSR1"


def stop_signals(names: str | None = None) -> list[signal.Signals]:
    """The signals that stop training together: ``names`` (a comma-separated list such as
    ``"SIGTERM,SIGUSR1"``; ``"none"`` for none), else ``BUCKETDDP_STOP_SIGNALS``, else
    SIGTERM and SIGUSR1. Raises ``ValueError`` naming an unknown signal."""
    text = names if names is not None else os.environ.get(ENV, DEFAULT)
    out = []
    for raw in text.replace(" ", "").split(","):
        if not raw or raw.lower() == "none":
            continue
        name = raw.upper() if raw.upper().startswith("SIG") else f"SIG{raw.upper()}"
        found = getattr(signal.Signals, name, None)
        if found is None or found in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{ENV}: {raw!r} is not a signal that can be caught")
        out.append(found)
    return out


class Preempted(SystemExit):
    """Raised on every rank once the snapshot of the stop step is written: the process
    exits with 128 + the signal's number, and torchrun's restart resumes from that step."""


class Notice:
    """This process's stop notice (see the module docstring)."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the signal this rank got, if any
        self.agreed = False  # some rank got one: the ranks stop after this step
        self._previous: dict[int, Any] = {}

    @property
    def pending(self) -> bool:
        """Whether this rank got a stop signal (the reducer writes it into the row)."""
        return self.signum is not None

    def install(self, signals: list[signal.Signals]) -> None:
        """Take ``signals`` over (from the main thread; elsewhere a no-op), keeping the
        handlers they had for ``uninstall``."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in signals:
            previous = signal.signal(sig, self._handler)
            self._previous.setdefault(int(sig), previous)

    def uninstall(self) -> None:
        """Give the signals back their previous handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def installed(self) -> bool:
        """Whether the handler holds any signal."""
        return bool(self._previous)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: a handler runs on this rank alone, so it must not communicate.
        if self.signum is None:
            self.signum = signum

    def heard(self, total: float) -> None:
        """The summed stop slot of a step's row: any rank's notice stops them all."""
        if total > 0:
            self.agreed = True

    def exit_code(self) -> int:
        """128 + the signal this rank got (SIGTERM's if another rank got it)."""
        return 128 + (self.signum or int(signal.SIGTERM))

    def reset(self) -> None:
        """Forget a notice (after a stop was handled, or for a new job in this process)."""
        self.signum = None
        self.agreed = False


NOTICE = Notice()
