"""Lightning's launchers, with the watchdog naming the ranks they started.

Lightning's own launcher (``_SubprocessScriptLauncher``) starts ranks 1.. of a node as
child scripts of rank 0, and a thread of its kills every process, rank 0 included, with
SIGKILL within five seconds of a child's non-zero exit. Under BucketDDP the watchdog
(``bucketddp.faults``) ends every rank first, naming the failed one (and the signal of a
child that was killed, which only its parent can see). This launcher hands the children to
the watchdog, keeps Lightning's kill as a late last resort, and gives children the chance to
exit with their own error before it signals them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher as _FabricProcessLauncher,
)
from lightning.fabric.strategies.launchers.subprocess_script import (
    _ChildProcessObserver,
)
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _FabricScriptLauncher,
)
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from .faults import adopt_children, current
from .faults.monitor import GRACE

# Lightning's kill of the whole job comes only this long after a child failed: by then
# the watchdog has named the failure and ended this process, unless it is stuck.
LAST_RESORT = 3 * GRACE


class _LateObserver(_ChildProcessObserver):
    def _terminate_all(self) -> None:
        time.sleep(LAST_RESORT)
        super()._terminate_all()


def _launch(
    launcher: _SubprocessScriptLauncher | _FabricScriptLauncher,
    function: Callable[..., Any],
    args: Any,
    kwargs: Any,
) -> Any:
    """What Lightning's script launchers do, with the children handed to the watchdog."""
    env = launcher.cluster_environment
    env.validate_settings(num_devices=launcher.num_processes, num_nodes=launcher.num_nodes)
    if not env.creates_processes_externally:
        launcher._call_children_scripts()
        first = env.node_rank() * launcher.num_processes
        adopt_children({first + i + 1: proc for i, proc in enumerate(launcher.procs)})
        _LateObserver(child_processes=launcher.procs, main_pid=os.getpid()).start()
    _set_num_threads_if_needed(num_processes=launcher.num_processes)
    return function(*args, **kwargs)


def _post(exc: BaseException) -> None:
    if (dog := current()) is not None:
        dog.report_exception(exc)


class WatchedScriptLauncher(_SubprocessScriptLauncher):
    """The Trainer's ``_SubprocessScriptLauncher`` whose children the watchdog watches."""

    def launch(
        self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any
    ) -> Any:
        """Start the child scripts, hand them to the watchdog, then call ``function``."""
        return _launch(self, function, args, kwargs)

    def kill(self, signum: Any) -> None:
        """Signal the children that are still running after a grace period.

        Called when this rank's training failed: the children's watchdogs end them with an
        error naming this rank first, so they exit with a code rather than by the signal.
        """
        deadline = time.monotonic() + GRACE
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        super().kill(signum)


class WatchedProcessLauncher(_MultiProcessingLauncher):
    """The Trainer's spawn/fork launcher; a rank's exception is posted for the others.

    Under it an exception in a rank never reaches the strategy's ``on_exception`` in that
    process (the launcher sends it to the main process instead), so it is posted here.
    """

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)
        except BaseException as exc:
            _post(exc)
            raise


class WatchedFabricScriptLauncher(_FabricScriptLauncher):
    """Fabric's ``_SubprocessScriptLauncher`` whose children the watchdog watches."""

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the child scripts, hand them to the watchdog, then call ``function``."""
        return _launch(self, function, args, kwargs)


class WatchedFabricProcessLauncher(_FabricProcessLauncher):
    """Fabric's spawn/fork launcher (``fabric.launch(fn)``); a rank's exception is posted."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)
        except BaseException as exc:
            _post(exc)
            raise
