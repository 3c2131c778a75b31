"""Lightning's launchers, with the watchdog naming the ranks they started (Fabric side).

Lightning's script launcher starts ranks 1.. of a node as child scripts of rank 0, and a
thread of its kills every process, rank 0 included, with SIGKILL within five seconds of a
child's non-zero exit. Under bucketddp's strategies the
watchdog (``bucketddp.faults``) ends every rank first, naming the failed one (and the
signal of a child that was killed, which only its parent can see). The launchers here hand
the children to the watchdog and keep Lightning's kill as a late last resort. This module
imports ``lightning.fabric`` only, so that Fabric's strategy registry can load it while
``lightning.pytorch`` is still being imported; ``trainer_launcher.py`` has the Trainer's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..faults import adopt_children, current
from ..faults.monitor import GRACE
from .internals import (
    FabricProcessLauncher,
    FabricScriptLauncher,
    LateObserver,
    ReportsRankExceptions,
    set_num_threads,
    start_children,
)

# Lightning's kill of the whole job comes only this long after a child failed: by then
# the watchdog has named the failure and ended this process, unless it is stuck.
LAST_RESORT = 3 * GRACE


def launch_watched(
    launcher: Any,
    function: Callable[..., Any],
    args: Any,
    kwargs: Any,
    before: Callable[[], None] | None = None,
) -> Any:
    """Lightning's script launch, with the children handed to the watchdog and
    ``before()`` called just before ``function``.

    ``launcher`` is the Trainer's or Fabric's script launcher. Lightning's own ``launch``
    is not called because it starts an observer that SIGKILLs every rank within five
    seconds of a child's failure, before the watchdog has named it; the rest of its body
    is the same four steps as here.
    """
    env = launcher.cluster_environment
    env.validate_settings(num_devices=launcher.num_processes, num_nodes=launcher.num_nodes)
    if not env.creates_processes_externally:
        children = start_children(launcher)
        first = env.node_rank() * launcher.num_processes
        adopt_children({first + i + 1: proc for i, proc in enumerate(children)})
        observer = LateObserver(child_processes=launcher.procs, main_pid=os.getpid())
        observer.delay = LAST_RESORT
        observer.start()
    set_num_threads(launcher.num_processes)
    if before is not None:
        before()
    return function(*args, **kwargs)


def post_exception(exc: BaseException) -> None:
    """Tell the other ranks (through the watchdog, if one runs) that this rank failed."""
    if (dog := current()) is not None:
        dog.report_exception(exc)


class WatchedFabricScriptLauncher(FabricScriptLauncher):
    """Fabric's script launcher whose children the watchdog watches."""

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the child scripts, hand them to the watchdog, then call ``function``."""
        return launch_watched(self, function, args, kwargs)


class PostsExceptions(ReportsRankExceptions):
    """Mixin for Lightning's spawn/fork launchers: a rank's exception is posted.

    Under them an exception in a rank is sent to the main process, not raised at the top of
    the rank's own process (nor, for the Trainer, through the strategy's ``on_exception``
    there), so it is posted here for the other ranks.
    """

    def rank_failed(self, exc: BaseException) -> None:
        """Post ``exc`` for the other ranks."""
        post_exception(exc)


class WatchedFabricProcessLauncher(PostsExceptions, FabricProcessLauncher):
    """Fabric's spawn/fork launcher (``fabric.launch(fn)``); a rank's exception is posted."""
