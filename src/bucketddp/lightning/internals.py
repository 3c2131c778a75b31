"""The one door to Lightning's private names.

Every private Lightning name bucketddp touches is used in this module and nowhere else,
one function or class per need (``tests/unit/test_lightning_door.py`` lists them and fails
when another module reaches one). Each entry says what it needs and the Lightning releases
it was checked on; ``python3 dev.py compat`` runs the strategies on each release of the
window. A Lightning release that renames one of them breaks here, in one place.

Only ``lightning.fabric`` is imported at the top: Fabric's strategy registry can load this
module while ``lightning.pytorch`` is still being imported, so the Trainer's launcher
classes are looked up on first use (module ``__getattr__``).
"""

from __future__ import annotations

import inspect
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# Checked on Lightning 2.4.0, 2.5.6 and 2.6.6: the launchers' classes (bases of ours,
# and what DDPStrategy's ``_configure_launcher`` picks), the thread that kills a node's
# processes when a child fails, Fabric's ``no_backward_sync`` interface, and the helper
# that sets the threads per process as Lightning's launchers do.
from lightning.fabric.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher as FabricProcessLauncher,
)
from lightning.fabric.strategies.launchers.subprocess_script import (
    _ChildProcessObserver,
)
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as FabricScriptLauncher,
)
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

if TYPE_CHECKING:
    # Checked on 2.4.0, 2.5.6 and 2.6.6: the registry's type (annotations only), and the
    # Trainer's launcher classes, which ``__getattr__`` below imports on first use.
    from lightning.fabric.strategies.registry import _StrategyRegistry as RegistryType
    from lightning.pytorch.strategies.launchers.multiprocessing import (
        _MultiProcessingLauncher as TrainerProcessLauncher,
    )
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher as TrainerScriptLauncher,
    )

__all__ = [
    "BackwardSyncControl",
    "FabricProcessLauncher",
    "FabricScriptLauncher",
    "FabricStrategyHooks",
    "LateObserver",
    "RegistryType",
    "ReportsRankExceptions",
    "TrainerProcessLauncher",
    "TrainerScriptLauncher",
    "TrainerStrategyHooks",
    "combined_mode",
    "ddp_device_ids",
    "dump_checkpoint",
    "fit_ckpt_path",
    "group_backend",
    "loader_and_fetcher",
    "set_backward_sync_control",
    "set_num_threads",
    "start_children",
    "validation_follows",
]


def __getattr__(name: str) -> Any:
    """The Trainer's launcher classes, imported when first asked for."""
    if name == "TrainerScriptLauncher":
        from lightning.pytorch.strategies.launchers import subprocess_script

        return subprocess_script._SubprocessScriptLauncher
    if name == "TrainerProcessLauncher":
        from lightning.pytorch.strategies.launchers import multiprocessing

        return multiprocessing._MultiProcessingLauncher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------- launchers
class LateObserver(_ChildProcessObserver):
    """Lightning's observer of a node's child scripts, whose kill of every process (rank 0
    included, SIGKILL) comes ``delay`` seconds late. Checked on 2.4.0, 2.5.6 and 2.6.6:
    ``_ChildProcessObserver(main_pid, child_processes)`` and its ``_terminate_all``."""

    delay = 0.0

    def _terminate_all(self) -> None:
        time.sleep(self.delay)
        super()._terminate_all()


def start_children(launcher: Any) -> list[subprocess.Popen[Any]]:
    """Start a script launcher's child scripts (ranks 1.. of this node); returns them.

    Checked on 2.4.0, 2.5.6 and 2.6.6: ``_call_children_scripts`` and ``procs``, the same
    for the Trainer's and Fabric's ``_SubprocessScriptLauncher``.
    """
    launcher._call_children_scripts()
    return list(launcher.procs)


def set_num_threads(num_processes: int) -> None:
    """Set torch's threads per process as Lightning's launchers do (checked on 2.4.0,
    2.5.6 and 2.6.6: ``_set_num_threads_if_needed``)."""
    _set_num_threads_if_needed(num_processes=num_processes)


class ReportsRankExceptions:
    """Mixin for the spawn/fork launchers: a rank's exception goes to ``rank_failed``
    before Lightning sends it to the main process.

    Checked on 2.4.0, 2.5.6 and 2.6.6: ``_MultiProcessingLauncher._wrapping_function``
    runs the function in each started process, for the Trainer and for Fabric.
    """

    def rank_failed(self, exc: BaseException) -> None:
        """Called with the exception that ends this rank's function."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)  # type: ignore[misc]
        except BaseException as exc:
            self.rank_failed(exc)
            raise


def fit_ckpt_path(function: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """The ``ckpt_path`` given to ``Trainer.fit``, from the call its launcher is asked to
    make; None if the function takes none.

    ``fit`` hands its arguments to the function it launches (``Trainer._fit_impl``), which
    names them as ``fit`` does: the value is found by that name, not by position. Checked
    on 2.4.0, 2.5.6 and 2.6.6.
    """
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return kwargs.get("ckpt_path")
    return bound.arguments.get("ckpt_path")


# ------------------------------------------------------------------------ strategies
class _LaunchersHook:
    """DDPStrategy's ``_configure_launcher`` (Trainer's and Fabric's; checked on 2.4.0,
    2.5.6 and 2.6.6), with the launcher Lightning picked handed to ``watched_launcher``."""

    _launcher: Any

    def watched_launcher(self, launcher: Any) -> Any:
        """The launcher to use in place of ``launcher``, Lightning's choice."""
        return launcher

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        self._launcher = self.watched_launcher(self._launcher)


class TrainerStrategyHooks(_LaunchersHook):
    """The private hooks of the Trainer's ``DDPStrategy`` that ``BucketDDP`` needs, routed to
    methods of its own (checked on 2.4.0, 2.5.6 and 2.6.6):

    - ``_configure_launcher``: ``watched_launcher(launcher)``;
    - ``_layer_sync``, the SyncBatchNorm plugin the accelerator connector assigns after
      the strategy is made: ``choose_layer_sync(plugin)`` decides what is kept, and
      ``layer_sync`` is what Lightning reads back.
    """

    layer_sync: Any = None

    def choose_layer_sync(self, plugin: Any) -> Any:
        """The plugin to keep when Lightning assigns ``plugin``."""
        return plugin

    @property
    def _layer_sync(self) -> Any:
        return self.layer_sync

    @_layer_sync.setter
    def _layer_sync(self, plugin: Any) -> None:
        self.layer_sync = self.choose_layer_sync(plugin)


class FabricStrategyHooks(_LaunchersHook):
    """The private hooks of Fabric's ``DDPStrategy`` that ``BucketFabricDDP`` needs, routed
    to methods of its own (checked on 2.4.0, 2.5.6 and 2.6.6):

    - ``_configure_launcher``: ``watched_launcher(launcher)``;
    - ``_setup_distributed``, which makes the process group:
      ``setup_process_group(lightnings_setup)``.
    """

    def setup_process_group(self, lightnings_setup: Callable[[], None]) -> None:
        """Make the process group; ``lightnings_setup()`` is what Lightning would do."""
        lightnings_setup()

    def _setup_distributed(self) -> None:
        self.setup_process_group(super()._setup_distributed)  # type: ignore[misc]


def group_backend(strategy: Any) -> str:
    """The backend a DDPStrategy would make its group with (checked on 2.4.0, 2.5.6 and
    2.6.6: ``_get_process_group_backend``, the same for the Trainer and Fabric)."""
    return str(strategy._get_process_group_backend())


def ddp_device_ids(strategy: Any) -> list[int] | None:
    """The ``device_ids`` Fabric's DDPStrategy would give the wrapper (checked on 2.4.0,
    2.5.6 and 2.6.6: ``_determine_ddp_device_ids``)."""
    ids: list[int] | None = strategy._determine_ddp_device_ids()
    return ids


def set_backward_sync_control(strategy: Any, control: BackwardSyncControl) -> None:
    """Make ``control`` what ``fabric.no_backward_sync`` uses (checked on 2.4.0, 2.5.6 and
    2.6.6: Fabric's ``Strategy._backward_sync_control``)."""
    strategy._backward_sync_control = control


# --------------------------------------------------------------------- trainer state
def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint ``trainer.save_checkpoint`` would write now, as a dict, without
    writing it or calling the strategy's save (checked on 2.4.0, 2.5.6 and 2.6.6:
    ``trainer._checkpoint_connector.dump_checkpoint``)."""
    checkpoint: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    return checkpoint


def validation_follows(trainer: Any) -> bool:
    """Whether the fit loop validates right after the training batch that just ended:
    asked at ``on_train_batch_end``, of Lightning's own test, which the loop runs again
    just after (checked on 2.4.0, 2.5.6 and 2.6.6: the training epoch loop's
    ``_should_check_val_fx(data_fetcher)``, and ``FitLoop._data_fetcher``)."""
    fit_loop = trainer.fit_loop
    return bool(fit_loop.epoch_loop._should_check_val_fx(fit_loop._data_fetcher))


def loader_and_fetcher(fit_loop: Any) -> tuple[Any, Any]:
    """The fit loop's training loaders (a ``CombinedLoader``) and the fetcher that made
    their iterator, or None for either not made yet (checked on 2.4.0, 2.5.6 and 2.6.6:
    ``FitLoop._combined_loader`` and ``_data_fetcher``)."""
    return fit_loop._combined_loader, fit_loop._data_fetcher


def combined_mode(combined: Any) -> str:
    """The mode of a ``CombinedLoader`` (``"max_size_cycle"`` for a fit's training loaders
    by default; checked on 2.4.0, 2.5.6 and 2.6.6: ``CombinedLoader._mode``)."""
    return str(combined._mode)


def complete_saved_batch(checkpoint: dict[str, Any], fit_loop: Any) -> None:
    """Count the training batch a checkpoint was saved at the end of (``on_train_batch_end``,
    before Lightning counts it completed) as done, as Lightning 2.5 and later do when they
    restart from it (``restarted_on_train_batch_end``). Lightning 2.4 does not: its resumed
    epoch numbered the later batches one lower, so a validation every ``n`` batches ran a
    batch late. Does nothing on a Lightning that does it itself (checked on 2.4.0, where it
    acts, and 2.5.6 and 2.6.6: the fit loop's ``epoch_loop.batch_progress`` and the epoch
    loop's ``_batches_that_stepped`` in the checkpoint's ``loops``)."""
    if hasattr(fit_loop.epoch_loop, "restarted_on_train_batch_end"):
        return
    state = checkpoint.get("loops", {}).get("fit_loop", {})
    progress = state.get("epoch_loop.batch_progress")
    if not progress or "total" not in progress:
        return
    total = progress["total"]
    if not total["ready"] == total["started"] == total["processed"] == total["completed"] + 1:
        return
    for part in ("total", "current"):
        progress[part]["completed"] = progress[part]["processed"]
    loop_state = state.get("epoch_loop.state_dict", {})
    if "_batches_that_stepped" in loop_state:
        loop_state["_batches_that_stepped"] += 1
