"""BucketDDP: the Lightning strategy, a drop-in for ``Trainer(strategy="ddp")``.

It is Lightning's own ``DDPStrategy`` (launchers, cluster environments, process group set-up,
barrier, reduce, broadcast and checkpoint IO are all inherited) with one change of wrapper:
while fitting, the LightningModule is wrapped in ``BucketDataParallel`` instead of torch's
``DistributedDataParallel``. What follows from the change lives here too (what it adds to
checkpoints and how it reads them in ``trainer_checkpoints.py``, its base class):

- gradient accumulation and ``toggle_model(sync_grad=False)`` skip communication through
  ``BucketDataParallel.no_sync``;
- buffers are synced by their policies before validation, before a checkpoint is written
  and at the end of fit;
- the learned bucket order and a stateful comm hook's state travel in the checkpoint, and
  a checkpoint only rank 0 can see is read there and sent to the others;
- a fit resumed from a checkpoint starts its first epoch where the uninterrupted fit would:
  in that epoch's sample order, where Lightning's loop would replay epoch 0's
  (``bucketddp.lightning.sampler_epoch``);
- ``sync_batchnorm`` converts BatchNorm layers to ``bucketddp.SyncBatchNorm``, which also
  works on CPU/gloo, and converts them back at teardown.

Like the other modules of ``bucketddp.lightning``, it imports Lightning.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_warn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from typing_extensions import override

from ..buffers import Policy
from ..checkpoint import Source, check_source
from ..faults import PROGRESS
from ..faults import current as current_watchdog
from ..faults.progress import COLLECTIVE
from ..options import DEFAULT_STALL_TIMEOUT
from ..parallel import BucketDataParallel
from .common import (
    StrategyOptions,
    destroy_at_exit,
    init_restartable_group,
    register_twins,
)
from .hook_checkpoint import HookCheckpoint
from .internals import (
    TrainerProcessLauncher,
    TrainerScriptLauncher,
    TrainerStrategyHooks,
    group_backend,
    loader_and_fetcher,
)
from .layer_sync import TORCH_SYNCBN_REPLACED, BucketSyncBatchNorm
from .plans import adopt_plan, plan_entry
from .sampler_epoch import SavedLoaders, realign_sampler_epoch
from .trainer_checkpoints import TrainerCheckpoints
from .trainer_elastic import TrainerElastic
from .trainer_launcher import WatchedProcessLauncher, WatchedScriptLauncher

# Lightning's private names are reached through ``internals.py`` only.
if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.plugins.precision import Precision

    from .internals import RegistryType

__all__ = ["BucketDDP", "BucketSyncBatchNorm"]

log = logging.getLogger(__name__)

UNUSED_HINT = (
    "Pass BucketDDP(find_unused_parameters=True), or "
    'Trainer(strategy="bucket_ddp_find_unused_parameters_true")'
)
"""How the error about parameters without a gradient names the strategy's option."""


class BucketDDP(TrainerStrategyHooks, TrainerCheckpoints):
    """Lightning's DDP strategy with bucketddp's gradient reducer and buffer policies.

    ``Trainer(strategy=BucketDDP())`` trains like ``Trainer(strategy="ddp")``, with the same
    launchers and cluster environments (subprocess, spawn, torchrun, SLURM), and gets
    ``BucketDataParallel``'s reducer, a sync policy per buffer and a SyncBatchNorm that
    works on CPU. Outside of fit (validate, test, predict) no wrapper is attached and the
    parameters and buffers are broadcast from rank 0, as with ``DDPStrategy``.

    The engine options are keywords, as ``BucketDataParallel`` takes them:
    ``bucket_cap_mb``, ``first_bucket_mb``, ``find_unused_parameters``,
    ``gradient_as_bucket_view``, ``broadcast_buffers``, ``buffer_sync``,
    ``default_buffer_policy``, ``static_graph``, ``init_sync``, ``forward_sync_buffers``,
    ``check_finite``, ``telemetry``, ``watchdog`` and ``stall_timeout``; see
    ``bucketddp.options.EngineOptions`` for each, and ``docs/reliability.md`` for the last
    two. The other keywords are as for Lightning's ``DDPStrategy``.

    Args:
        sync_batchnorm: convert BatchNorm layers to ``bucketddp.SyncBatchNorm`` while
            fitting, as ``Trainer(sync_batchnorm=True)`` does.
        ddp_comm_hook: a communication hook, ``hook(state, bucket) -> Future``, registered
            on the wrapper (``BucketDataParallel.register_comm_hook``) on every accelerator,
            CPU included; for example ``default_hooks.fp16_compress_hook``.
        ddp_comm_state: the hook's state, e.g. a ``PowerSGDState``, or a
            ``PostLocalSGDState`` for post-local SGD (with ``post_localSGD_hook`` and
            ``model_averaging_period``).
        ddp_comm_wrapper: applied to the hook, e.g. ``default_hooks.fp16_compress_wrapper``.
        model_averaging_period: post-local SGD: average the parameters over all ranks every
            this many optimizer steps once local SGD has started, as ``DDPStrategy`` does.
            Required with a ``PostLocalSGDState``, refused without one.
        checkpoint_source: who reads ``ckpt_path``: ``"auto"`` (rank 0 reads and sends it
            to the ranks when some rank does not see the file; else each rank reads its
            own), ``"rank0"`` (always rank 0) or ``"local"`` (each rank, as ``"ddp"``).
            See ``bucketddp.load_checkpoint``.
        elastic: under torchrun, snapshot the training state to node-local shared memory
            and, after torchrun restarts the workers, resume from the newest snapshot on
            any node, at the same world size or another (``docs/elastic.md``).
        snapshot_every: with ``elastic``, take a snapshot every this many optimizer steps.
        preempt_dir: with ``elastic``, a folder on disk (reachable from every node that may
            run the job) that a stop on a signal copies its snapshot to: the job, started
            again anywhere (a SLURM requeue), resumes from it. If None,
            ``BUCKETDDP_PREEMPT_DIR``; else, under SLURM's srun with Lightning's
            auto-requeue, ``<default_root_dir>/bucketddp-preempt-<job id>``; else none.
        accelerator: as for Lightning's ``DDPStrategy`` (the Trainer's when None).
        parallel_devices: as for ``DDPStrategy``: this node's devices (the Trainer's ``devices``).
        cluster_environment: as for ``DDPStrategy``: where rank and world size come from.
        checkpoint_io: as for ``DDPStrategy``: the plugin that writes and reads checkpoints.
        precision_plugin: as for ``DDPStrategy`` (from the Trainer's ``precision`` when None).
        process_group_backend: as for ``DDPStrategy``: ``"gloo"``, ``"nccl"``, ... (chosen
            from the device when None).
        timeout: as for ``DDPStrategy``: the process group's timeout.
        start_method: as for ``DDPStrategy``: ``"popen"`` (processes started as scripts),
            ``"spawn"``, ``"fork"`` or ``"forkserver"``.

    Raises:
        TypeError: a bad engine option (see ``EngineOptions``), or a ``sync_batchnorm`` or
            ``elastic`` other than True or False.
        ValueError: a bad engine option (see ``EngineOptions``), a hook state or wrapper
            without a hook, a ``model_averaging_period`` that is missing with a
            ``PostLocalSGDState``, given without one, or not a positive integer, an
            unknown ``checkpoint_source``, or a ``snapshot_every`` that is not a positive
            integer.
    """

    def __init__(
        self,
        *,
        # The engine options (EngineOptions), ...
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: float | str | None = 25.0,
        first_bucket_mb: float | str | None = None,
        gradient_as_bucket_view: bool = True,
        init_sync: bool = True,
        buffer_sync: Mapping[str, Policy] | None = None,
        default_buffer_policy: Policy | None = None,
        broadcast_buffers: bool | None = None,
        forward_sync_buffers: bool | None = None,
        check_finite: bool = False,
        telemetry: bool = True,
        watchdog: bool = True,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
        # ... DDPStrategy's for SyncBatchNorm and communication hooks, ...
        sync_batchnorm: bool = False,
        ddp_comm_hook: Callable[..., Any] | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        model_averaging_period: int | None = None,
        # ... and the rest of DDPStrategy's.
        accelerator: Accelerator | None = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        checkpoint_source: Source = "auto",
        # Elastic training under torchrun (docs/elastic.md).
        elastic: bool = False,
        snapshot_every: int = 1,
        preempt_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        options = StrategyOptions.from_arguments(locals(), UNUSED_HINT)
        every = options.snapshot_every
        self._elastic = TrainerElastic(every, preempt_dir) if every is not None else None
        self._checkpoint_source = check_source(checkpoint_source)
        self._engine_options = options.engine
        self._comm_hook = options.comm_hook
        self._hook_checkpoint = HookCheckpoint(self._comm_hook)
        # Set before DDPStrategy.__init__, which assigns the SyncBatchNorm plugin
        # (``choose_layer_sync``).
        self._sync_batchnorm = sync_batchnorm
        self._group_timeout = timeout
        self._start_method_name = start_method
        # DDPStrategy keeps the wrapper's keyword arguments: ours, checked, for code that
        # reads them there; ``wrap_model`` passes the options themselves.
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            # DDPStrategy.setup() enables model averaging (post-local SGD) from these two;
            # the hook itself is registered by ``configure_ddp`` below, on every accelerator.
            ddp_comm_state=ddp_comm_state,
            model_averaging_period=model_averaging_period,
            **self._engine_options.keywords(),
        )
        self._saved_plan = None
        self._learned_plan = None
        self._saved_loaders = SavedLoaders()

    # ------------------------------------------------------------------ SyncBatchNorm
    # The accelerator connector assigns the plugin after construction: Lightning's
    # TorchSyncBatchNorm for ``Trainer(sync_batchnorm=True)`` and None otherwise. The
    # strategy puts its own plugin in place of the first, and keeps
    # ``BucketDDP(sync_batchnorm=True)`` in force over the second.
    @override
    def choose_layer_sync(self, plugin: LayerSync | None) -> LayerSync | None:
        """The SyncBatchNorm plugin to keep when Lightning assigns ``plugin``."""
        # Lightning hands Trainer(sync_batchnorm=True) and plugins=[TorchSyncBatchNorm()] over
        # alike, so both are replaced, with a warning unless the strategy was asked itself.
        if type(plugin) is TorchSyncBatchNorm and not self._sync_batchnorm:
            rank_zero_warn(TORCH_SYNCBN_REPLACED)
        if type(plugin) is TorchSyncBatchNorm or (plugin is None and self._sync_batchnorm):
            plugin = BucketSyncBatchNorm()
        return plugin

    # ------------------------------------------------------------------ process group
    @override
    def setup_distributed(self) -> None:
        """DDPStrategy's setup, with a group that forms after torchrun restarts the workers."""
        existed = dist.is_available() and dist.is_initialized()
        if not existed:
            init_restartable_group(group_backend(self), self._group_timeout)
        super().setup_distributed()
        if not existed and dist.is_initialized():
            destroy_at_exit(dist.group.WORLD)

    @override
    def watched_launcher(self, launcher: Any) -> Any:
        """The launcher the watchdog watches, in place of the one Lightning picked."""
        if type(launcher) is TrainerScriptLauncher:
            assert self.cluster_environment is not None
            watched = WatchedScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
            if (elastic := self._elastic) is not None:
                watched.before_fit = functools.partial(elastic.before_fit, self)
            return watched
        if type(launcher) is TrainerProcessLauncher:  # spawn, fork or forkserver
            return WatchedProcessLauncher(self, start_method=self._start_method_name)  # type: ignore[arg-type]
        return launcher

    # ------------------------------------------------------------------- failures
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks (through the watchdog) that this rank's training failed."""
        if (dog := current_watchdog()) is not None:
            dog.report_exception(exception)
        super().on_exception(exception)

    @override
    def barrier(self, name: str | None = None) -> None:
        """DDPStrategy's barrier, marked as a collective for the stall check. Under
        ``elastic=True``, the fit's first (``"run-stage"``) takes the stop signals over."""
        if name == "run-stage" and self._elastic is not None and self.lightning_module is not None:
            self._elastic.listen(self.lightning_module.trainer)
        with PROGRESS.during(COLLECTIVE, f"barrier {name}" if name else "barrier"):
            super().barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """DDPStrategy's broadcast, marked as a collective for the stall check."""
        with PROGRESS.during(COLLECTIVE, "broadcast"):
            return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """DDPStrategy's reduce (``self.log(sync_dist=True)``), marked for the stall check."""
        with PROGRESS.during(COLLECTIVE, "reduce"):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)

    # ------------------------------------------------------------------- wrapping
    def wrap_model(self, model: Module) -> BucketDataParallel:
        """Wrap ``model`` in ``BucketDataParallel`` with this strategy's options."""
        log.debug(
            "%s: wrapping the model in BucketDataParallel(%s)",
            type(self).__name__,
            self._engine_options,
        )
        return BucketDataParallel(model, options=self._engine_options)

    @override
    def configure_ddp(self) -> None:
        """Wrap the LightningModule and adopt the bucket order of a loaded checkpoint."""
        assert isinstance(self.model, LightningModule)
        wrapped = self.wrap_model(self.model)
        if self._comm_hook is not None:
            wrapped.register_comm_hook(*self._comm_hook)
        self.model = wrapped
        self._learned_plan = None
        entry, self._saved_plan = self._saved_plan, None
        if entry:
            adopt_plan(wrapped, entry)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally: used for ``accumulate_grad_batches`` and
        ``toggle_model(sync_grad=False)``."""
        wrapped = self._wrapped
        if wrapped is None:
            yield
            return
        with wrapped.no_sync():
            yield

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Manual optimization: each ``manual_backward`` is reduced (or, inside
        ``toggle_model(sync_grad=False)``, kept local), as Lightning arranges for torch DDP."""
        wrapped = self._wrapped
        module = self.lightning_module
        if wrapped is not None and module is not None and not module.automatic_optimization:
            wrapped.prepare_for_backward(closure_loss)

    # ---------------------------------------------------------------- buffer syncs
    def _sync_buffers(self) -> None:
        # Only while fitting: outside of fit there is no wrapper, and DDPStrategy has already
        # broadcast parameters and buffers from rank 0.
        if (wrapped := self._wrapped) is not None:
            wrapped.sync_buffers()

    @override
    def on_validation_start(self) -> None:
        """Sync buffers by their policies, so every rank validates the same model."""
        self._sync_buffers()
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        """Under ``elastic=True``, a validation run inside the fit ends: the snapshot of the
        step before it is taken now, after every callback's ``on_validation_end``."""
        super().on_validation_end()
        module, wrapped = self.lightning_module, self._wrapped
        if self._elastic is not None and module is not None and wrapped is not None:
            self._elastic.validation_ended(module.trainer, wrapped, self.plan_entry())

    @override
    def on_test_start(self) -> None:
        """Sync buffers by their policies, so every rank tests the same model."""
        self._sync_buffers()
        super().on_test_start()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Under ``elastic=True``, the training loader's sampler becomes an
        ``ElasticSampler`` (a resumed epoch goes on where it stopped, at any world size)."""
        if self._elastic is not None and self.lightning_module is not None:
            return self._elastic.process_dataloader(self.lightning_module.trainer, dataloader)
        return dataloader

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """DDPStrategy's; after a resume, the first one first puts back the comm hook's
        state and (elastic) this rank's RNG states and own buffers."""
        if self._elastic is not None:
            self._elastic.before_training_step(self._wrapped)
        self._hook_checkpoint.restore(self.root_device)
        return super().training_step(*args, **kwargs)

    @override
    def on_train_start(self) -> None:
        """A resumed fit: give the training samplers the resumed epoch before its first
        batch (``sampler_epoch.py``), so that it is not trained on epoch 0's order."""
        saved, self._saved_loaders = self._saved_loaders, SavedLoaders()
        assert self.lightning_module is not None
        fit_loop = self.lightning_module.trainer.fit_loop
        combined, fetcher = loader_and_fetcher(fit_loop)
        if self._elastic is not None:
            self._elastic.check_loaders(combined)
        if realign_sampler_epoch(fit_loop, saved, combined, fetcher):
            rank_zero_debug(
                "BucketDDP: the training samplers were at another epoch than the resumed "
                "one; set it, and made the loader's iterator again"
            )
        super().on_train_start()

    @override
    def on_train_end(self) -> None:
        """Sync buffers once more, so the module the user holds after fit agrees."""
        self._sync_buffers()
        super().on_train_end()

    # -------------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        """Unwrap the model and remove the reducer's hooks, so the user's module is plain;
        DDPStrategy's teardown then reverts SyncBatchNorm and moves the model to CPU."""
        if (wrapped := self._wrapped) is not None:
            self._learned_plan = plan_entry(wrapped)
            wrapped.remove_hooks()
            self.model = self.lightning_module
        self._saved_plan = None
        self._saved_loaders = SavedLoaders()
        super().teardown()

    # ------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: RegistryType) -> None:
        """Register a bucket twin of each DDP name the Trainer registers ("bucket_ddp",
        "bucket_ddp_notebook", "bucket_ddp_spawn_find_unused_parameters_true", ...)."""
        register_twins(cls, strategy_registry, "trainer")


BucketDDP.register_strategies(StrategyRegistry)
