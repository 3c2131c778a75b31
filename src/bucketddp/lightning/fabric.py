"""BucketFabricDDP: the Fabric strategy, a drop-in for ``Fabric(strategy="ddp")``.

It is Fabric's own ``DDPStrategy`` (launchers, cluster environments, process group set-up,
collectives and checkpoint IO are inherited) with one change of wrapper: ``fabric.setup``
wraps the model in ``BucketDataParallel`` instead of torch's ``DistributedDataParallel``.
What follows from the change lives here too:

- ``fabric.no_backward_sync(model)`` accumulates through ``BucketDataParallel.no_sync``;
- ``sync_batchnorm`` converts BatchNorm layers to ``bucketddp.SyncBatchNorm`` at setup;
- a communication hook is registered on every accelerator; with post-local SGD the
  parameters are averaged after every ``model_averaging_period`` optimizer steps;
- ``fabric.save`` syncs buffers by their policies and writes the module without the
  wrapper, with the bucket plan (learned order, tuned sizes) under
  ``checkpoint["bucketddp"]``, which ``fabric.load`` takes back out and adopts;
- ``fabric.load`` of a file only rank 0 can see reads it there and sends it to the others
  (``bucketddp.checkpoint``).

Like ``trainer.py``, it imports Lightning (see ``bucketddp.lightning``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.utilities.cloud_io import get_filesystem
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from .._compat import weights_only_kwargs
from ..bucket_plan import adopt_plan, is_plan_entry, plan_entry
from ..buffers import Policy
from ..checkpoint import Source, check_source, load_checkpoint, strip_prefix
from ..elastic import Elastic, ElasticSampler
from ..faults import release
from ..options import DEFAULT_STALL_TIMEOUT, EngineOptions
from ..parallel import BucketDataParallel
from ..syncbn import convert_sync_batchnorm
from .common import (
    CHECKPOINT_KEY,
    StrategyOptions,
    destroy_at_exit,
    init_restartable_group,
    is_post_local_sgd,
    register_twins,
)
from .fabric_launcher import WatchedFabricProcessLauncher, WatchedFabricScriptLauncher
from .fabric_loaders import FabricLoaders
from .internals import (
    BackwardSyncControl,
    FabricProcessLauncher,
    FabricScriptLauncher,
    FabricStrategyHooks,
    ddp_device_ids,
    group_backend,
    set_backward_sync_control,
)

# Lightning's private names are reached through ``internals.py`` only.
if TYPE_CHECKING:
    from lightning.fabric.accelerators import Accelerator
    from lightning.fabric.plugins import ClusterEnvironment, Precision
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    from .internals import RegistryType

__all__ = ["BucketFabricDDP"]

log = logging.getLogger(__name__)

UNUSED_HINT = (
    "Pass BucketFabricDDP(find_unused_parameters=True), or "
    'Fabric(strategy="bucket_ddp_find_unused_parameters_true")'
)
"""How the error about parameters without a gradient names the strategy's option."""


class BucketFabricDDP(FabricStrategyHooks, DDPStrategy):
    """Fabric's DDP strategy with bucketddp's gradient reducer and buffer policies.

    ``Fabric(strategy=BucketFabricDDP())`` runs like ``Fabric(strategy="ddp")``, with the
    same launchers and cluster environments, and ``fabric.setup(model)`` returns the model
    wrapped in ``BucketDataParallel``: its reducer, a sync policy per buffer (from
    ``buffer_sync`` or the module's ``configure_buffer_sync()``) and, with
    ``sync_batchnorm=True``, a SyncBatchNorm that works on CPU.

    The engine options are keywords, as ``BucketDataParallel`` takes them:
    ``bucket_cap_mb``, ``first_bucket_mb``, ``find_unused_parameters``,
    ``gradient_as_bucket_view``, ``broadcast_buffers``, ``buffer_sync``,
    ``default_buffer_policy``, ``static_graph``, ``init_sync``, ``forward_sync_buffers``,
    ``check_finite``, ``telemetry``, ``watchdog`` and ``stall_timeout``; see
    ``bucketddp.options.EngineOptions`` for each, and ``docs/reliability.md`` for the last
    two. The other keywords are as for Fabric's ``DDPStrategy``.

    Args:
        sync_batchnorm: convert BatchNorm layers to ``bucketddp.SyncBatchNorm`` in
            ``fabric.setup`` (in place: the model keeps its parameters).
        ddp_comm_hook: a communication hook, ``hook(state, bucket) -> Future``, registered
            on the wrapper on every accelerator, CPU included; for example
            ``default_hooks.fp16_compress_hook``.
        ddp_comm_state: the hook's state, e.g. a ``PowerSGDState``, or a
            ``PostLocalSGDState`` for post-local SGD (with ``model_averaging_period``).
        ddp_comm_wrapper: applied to the hook, e.g. ``default_hooks.fp16_compress_wrapper``.
        model_averaging_period: post-local SGD: average the parameters over all ranks every
            this many optimizer steps once local SGD has started. Required with a
            ``PostLocalSGDState``, refused without one.
        checkpoint_source: who reads the file in ``fabric.load``: ``"auto"`` (rank 0 reads
            and sends it when some rank does not see it; else each rank reads its own),
            ``"rank0"`` (always rank 0) or ``"local"`` (each rank). See
            ``bucketddp.load_checkpoint``.
        elastic: under torchrun, ``strategy.elastic(state)`` gives the loop snapshots in
            node-local shared memory and resume after torchrun restarts the workers
            (``bucketddp.elastic.Elastic``, ``docs/elastic.md``).
        snapshot_every: with ``elastic``, take a snapshot every this many steps.

        accelerator: as for Lightning's ``DDPStrategy``: the accelerator (the Trainer
            sets it from its ``accelerator`` argument when None).
        parallel_devices: as for ``DDPStrategy``: the devices of this node (from the
            Fabric's ``devices`` when None).
        cluster_environment: as for ``DDPStrategy``: where rank and world size come from
            (torchrun, SLURM, ...; detected when None).
        checkpoint_io: as for ``DDPStrategy``: the plugin that writes and reads
            checkpoints.
        precision: as for ``DDPStrategy``: the precision plugin (from the Fabric's
            ``precision`` when None).
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
        # ... SyncBatchNorm and communication hooks, as BucketDDP takes them, ...
        sync_batchnorm: bool = False,
        ddp_comm_hook: Callable[..., Any] | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        model_averaging_period: int | None = None,
        # ... and the rest of Fabric's DDPStrategy.
        accelerator: Accelerator | None = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        checkpoint_source: Source = "auto",
        # Elastic training under torchrun (docs/elastic.md).
        elastic: bool = False,
        snapshot_every: int = 1,
    ) -> None:
        self._options = StrategyOptions.from_arguments(locals(), UNUSED_HINT)
        self._checkpoint_source = check_source(checkpoint_source)
        self._group_timeout = timeout
        self._start_method_name = start_method
        # DDPStrategy keeps the wrapper's keyword arguments: ours, checked, for code that
        # reads them there; ``setup_module`` passes the options themselves.
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **self.engine_options.keywords(),
        )
        set_backward_sync_control(self, _BucketBackwardSyncControl())
        self._averager: PeriodicModelAverager | None = None
        self._wrapped: weakref.WeakSet[BucketDataParallel] = weakref.WeakSet()
        self._loaders = FabricLoaders()

    @property
    def engine_options(self) -> EngineOptions:
        """The options every module set up with this strategy is wrapped with."""
        return self._options.engine

    def elastic(self, state: dict[str, Any], **kwargs: Any) -> Elastic:
        """Snapshots and resume for a Fabric loop's ``state`` (models and optimizers from
        ``fabric.setup``, counters), every ``snapshot_every`` steps: ``Elastic(state,
        **kwargs)`` (see ``bucketddp.elastic.Elastic``).

        For a loader set up with ``fabric.setup_dataloaders`` (before this call), pass
        ``sampler=loader.sampler``: the strategy put a resumable sampler in its place that
        follows Fabric's epochs (``fabric_loaders.py``).

        Raises:
            RuntimeError: the strategy was made without ``elastic=True``.
            TypeError: a ``sampler`` that cannot resume an epoch.
        """
        every = self._options.snapshot_every
        if every is None:
            raise RuntimeError(
                "strategy.elastic() needs BucketFabricDDP(elastic=True, snapshot_every=...)"
            )
        sampler = self._loaders.sampler_for(kwargs.get("sampler"))
        if sampler is not None and not isinstance(sampler, ElasticSampler):
            raise TypeError(
                f"strategy.elastic(sampler=...): the loader draws from a "
                f"{type(sampler).__name__}, which cannot resume an epoch. Set up a torch "
                "DataLoader (shuffled or not, with no sampler of yours) with "
                "fabric.setup_dataloaders before strategy.elastic(), and pass loader.sampler; "
                "or give the loader a bucketddp.elastic.ElasticSampler"
            )
        return Elastic(state, every=every, **{**kwargs, "sampler": sampler})

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Under ``elastic=True``, the loader's ``DistributedSampler`` becomes a resumable
        one that follows Fabric's epochs after a restart too (``fabric_loaders.py``)."""
        dataloader = super().process_dataloader(dataloader)
        if self._options.snapshot_every is None:
            return dataloader
        return self._loaders.follow(dataloader)

    # ------------------------------------------------------------------ process group
    @override
    def setup_process_group(self, lightnings_setup: Callable[[], None]) -> None:
        """Lightning's set-up of the group, with a group that forms after torchrun restarts
        the workers."""
        existed = dist.is_available() and dist.is_initialized()
        if not existed:
            init_restartable_group(group_backend(self), self._group_timeout)
        lightnings_setup()
        if not existed and dist.is_initialized():
            destroy_at_exit(dist.group.WORLD)

    @override
    def watched_launcher(self, launcher: Any) -> Any:
        """The launcher the watchdog watches, in place of the one Lightning picked."""
        if type(launcher) is FabricScriptLauncher:
            assert self.cluster_environment is not None
            return WatchedFabricScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        if type(launcher) is FabricProcessLauncher:  # spawn, fork or forkserver
            return WatchedFabricProcessLauncher(self, start_method=self._start_method_name)  # type: ignore[arg-type]
        return launcher

    # ------------------------------------------------------------------- wrapping
    @override
    def setup_module(self, module: Module) -> BucketDataParallel:  # type: ignore[override]
        """Convert BatchNorm if asked, wrap ``module`` in ``BucketDataParallel`` with this
        strategy's options and register the communication hook."""
        if self._options.sync_batchnorm:
            module = convert_sync_batchnorm(module)
        log.debug(
            "BucketFabricDDP: wrapping the model in BucketDataParallel(%s)", self.engine_options
        )
        wrapped = BucketDataParallel(
            module, device_ids=ddp_device_ids(self), options=self.engine_options
        )
        if self._options.comm_hook is not None:
            wrapped.register_comm_hook(*self._options.comm_hook)
        if self._options.averaging is not None and self._averager is None:
            self._averager = _averager(*self._options.averaging)
        self._wrapped.add(wrapped)
        return wrapped

    @override
    def teardown(self) -> None:
        """Stop watching the modules set up here (the watchdog ends with the last one),
        then Fabric's teardown. The modules stay wrapped and usable, as with "ddp"."""
        for wrapped in list(self._wrapped):
            release(wrapped)
        super().teardown()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step, then, under post-local SGD, average the parameters when due."""
        output = super().optimizer_step(optimizer, **kwargs)
        if self._averager is not None:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self._averager.average_parameters(iter(params))
        return output

    # ---------------------------------------------------------------- checkpoints
    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The module's state dict without the wrapper's prefix, as rank 0 writes it.

        Buffers whose policy combines the ranks' values (``"mean"``, ``"sum"``...) are
        synced first: ``fabric.save`` runs on every rank, so that sync is a collective like
        any other. ``"broadcast"`` and ``"none"`` buffers are written from rank 0's own
        values, with no collective.
        """
        if isinstance(module, BucketDataParallel):
            module.sync_buffers_to_save()
            module = module.module
        return super().get_module_state_dict(module)

    @override
    def load_module_state_dict(
        self, module: Module, state_dict: dict[str, Any], strict: bool = True
    ) -> None:
        """Load into the module inside the wrapper; keys saved from a wrapper (every key
        ``module.*``) load too."""
        if isinstance(module, BucketDataParallel):
            module = module.module
        state_dict = dict(strip_prefix(state_dict, model_keys=module.state_dict().keys()))
        super().load_module_state_dict(module, state_dict, strict=strict)

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save ``state``, with the bucket plan (learned order, tuned sizes:
        ``bucketddp.bucket_plan``) under ``checkpoint["bucketddp"]`` when it holds one model
        of this strategy."""
        entry = _one_wrapper(state, plan_entry)
        if entry and CHECKPOINT_KEY not in state:
            state = {**state, CHECKPOINT_KEY: entry}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state``; a model of this strategy in it adopts the saved bucket plan.

        The plan entry is taken out of what is returned, so the remainder holds what the
        user saved. A file only rank 0 sees is read there and sent to the other ranks
        (``checkpoint_source``).
        """
        io = self.checkpoint_io
        self.checkpoint_io = _ReadThroughRank0(io, self._checkpoint_source)
        try:
            remainder = super().load_checkpoint(
                path, state, strict=strict, **weights_only_kwargs(weights_only)
            )
        finally:
            self.checkpoint_io = io
        if not is_plan_entry(remainder.get(CHECKPOINT_KEY)):
            return remainder  # no entry of ours (a key of the user's own is left alone)
        entry = remainder.pop(CHECKPOINT_KEY)
        if isinstance(state, dict):
            adopted = _one_wrapper(state, lambda w: adopt_plan(w, entry))
            if adopted is not None and "bucket_order" in entry and not adopted[1]:
                log.debug(
                    "BucketFabricDDP: the checkpoint's bucket order names other parameters "
                    "than the model has; the order is learned again in the first backward"
                )
        return remainder

    # ------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: RegistryType) -> None:
        """Register a bucket twin of each DDP name Fabric registers ("bucket_ddp",
        "bucket_ddp_spawn", "bucket_ddp_fork", "bucket_ddp_notebook" and
        "bucket_ddp_find_unused_parameters_true")."""
        register_twins(cls, strategy_registry, "fabric")


class _ReadThroughRank0(CheckpointIO):
    """The strategy's CheckpointIO, its reads going through ``bucketddp.load_checkpoint``."""

    def __init__(self, io: CheckpointIO, source: Source) -> None:
        self.io, self.source = io, source

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        read = functools.partial(self.io.load_checkpoint, **weights_only_kwargs(weights_only))
        exists = lambda p: get_filesystem(p).exists(p)  # noqa: E731
        loaded: dict[str, Any] = load_checkpoint(path, source=self.source, read=read, exists=exists)
        return loaded

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        self.io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        self.io.remove_checkpoint(path)


class _BucketBackwardSyncControl(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: ``BucketDataParallel.no_sync``."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Accumulate gradients locally while ``enabled``; forward and backward go inside."""
        if not enabled:
            return nullcontext()
        if not isinstance(module, BucketDataParallel):
            raise TypeError(
                "fabric.no_backward_sync() needs a model set up by BucketFabricDDP, wrapped in "
                f"BucketDataParallel; got {type(module).__name__}. Pass the model that "
                "fabric.setup(model) returned."
            )
        return module.no_sync()


def _one_wrapper(state: Any, fn: Callable[[BucketDataParallel], Any]) -> Any:
    """``fn`` of the one ``BucketDataParallel`` among ``state``'s values; None if not one."""
    if not isinstance(state, dict):
        return None
    wrappers = [v for v in state.values() if isinstance(v, BucketDataParallel)]
    return fn(wrappers[0]) if len(wrappers) == 1 else None


def _averager(state: object, period: int) -> PeriodicModelAverager:
    """Post-local SGD's parameter averager, from the step local SGD starts at."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    assert is_post_local_sgd(state)
    start = state.start_localSGD_iter  # type: ignore[attr-defined]
    return PeriodicModelAverager(period=period, warmup_steps=start)


BucketFabricDDP.register_strategies(STRATEGY_REGISTRY)
