"""The Trainer's launchers, with the watchdog naming the ranks they started.

See ``fabric_launcher.py`` for why: these are the same for ``lightning.pytorch``'s
launchers, used by ``BucketDDP``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from ..faults.monitor import GRACE
from .fabric_launcher import PostsExceptions, launch_watched


class WatchedScriptLauncher(_SubprocessScriptLauncher):
    """The Trainer's ``_SubprocessScriptLauncher`` whose children the watchdog watches.

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
            # fit's ckpt_path: the fifth argument of Trainer._fit_impl, or a keyword
            ckpt_path = args[4] if len(args) > 4 else kwargs.get("ckpt_path")
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


class WatchedProcessLauncher(PostsExceptions, _MultiProcessingLauncher):
    """The Trainer's spawn/fork launcher; a rank's exception is posted for the others."""
