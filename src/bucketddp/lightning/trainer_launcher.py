"""The Trainer's launchers, with the watchdog naming the ranks they started.

See ``fabric_launcher.py`` for why: these are the same for ``lightning.pytorch``'s
launchers, used by ``BucketDDP``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..faults.monitor import GRACE
from .fabric_launcher import PostsExceptions, launch_watched
from .internals import TrainerProcessLauncher, TrainerScriptLauncher, fit_ckpt_path


class WatchedScriptLauncher(TrainerScriptLauncher):
    """The Trainer's script launcher whose children the watchdog watches.

    ``before_fit(trainer, ckpt_path)``, if set, runs before the trainer's function, with
    the ``ckpt_path`` given to ``fit`` (``BucketDDP(elastic=True)`` finds its snapshot).
    """

    before_fit: Callable[[Any, Any], None] | None = None

    def launch(
        self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any
    ) -> Any:
        """Start the child scripts, hand them to the watchdog, then call ``function``."""
        before = self.before_fit
        if before is not None and trainer is not None:
            ckpt_path = fit_ckpt_path(function, args, kwargs)
            return launch_watched(
                self, function, args, kwargs, before=lambda: before(trainer, ckpt_path)
            )
        return launch_watched(self, function, args, kwargs)

    def kill(self, signum: Any) -> None:
        """Signal the children that are still running after a grace period.

        Called when this rank's training failed: the children's watchdogs end them with an
        error naming this rank first, so they exit with a code rather than by the signal.
        """
        deadline = time.monotonic() + GRACE
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        super().kill(signum)


class WatchedProcessLauncher(PostsExceptions, TrainerProcessLauncher):
    """The Trainer's spawn/fork launcher; a rank's exception is posted for the others."""
