"""BucketDDP: the Lightning strategy, a drop-in for ``Trainer(strategy="ddp")``.

It is Lightning's own ``DDPStrategy`` (launchers, cluster environments, process group set-up,
barrier, reduce, broadcast and checkpoint IO are all inherited) with one change of wrapper:
while fitting, the LightningModule is wrapped in ``BucketDataParallel`` instead of torch's
``DistributedDataParallel``. What follows from the change lives here too:

- gradient accumulation and ``toggle_model(sync_grad=False)`` skip communication through
  ``BucketDataParallel.no_sync``;
- buffers are synced by their policies before validation, before a checkpoint is written
  and at the end of fit;
- the learned bucket order travels in the checkpoint under ``checkpoint["bucketddp"]``;
- ``sync_batchnorm`` converts BatchNorm layers to ``bucketddp.SyncBatchNorm``, which also
  works on CPU/gloo, and converts them back at teardown.

This is the only module of the package that imports Lightning.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_debug
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from typing_extensions import override

from .buffers import Policy
from .options import EngineOptions, check_switches
from .parallel import BucketDataParallel
from .syncbn import convert_sync_batchnorm, revert_sync_batchnorm

# Private Lightning names this module depends on, listed in one place so that a Lightning
# release that changes one is found here first:
# - ``_StrategyRegistry`` (imported below, for an annotation only);
# - DDPStrategy's ``_ddp_kwargs`` (the wrapper's keyword arguments, passed through),
#   ``_layer_sync`` (the SyncBatchNorm plugin the accelerator connector assigns) and
#   ``_setup_model`` (the hook that wraps the module), all overridden or read below.
if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.plugins.precision import Precision

__all__ = ["BucketDDP", "BucketSyncBatchNorm"]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "bucketddp"
"""The checkpoint entry BucketDDP adds: ``{"bucket_order": [parameter names]}``."""

UNUSED_HINT = (
    "Pass BucketDDP(find_unused_parameters=True), or "
    'Trainer(strategy="bucket_ddp_find_unused_parameters_true")'
)
"""How the error about parameters without a gradient names the strategy's option."""


class BucketSyncBatchNorm(LayerSync):
    """Lightning's LayerSync plugin with ``bucketddp.SyncBatchNorm``: works on every backend.

    ``BucketDDP`` puts it in place of Lightning's ``TorchSyncBatchNorm`` whenever
    ``Trainer(sync_batchnorm=True)`` or ``BucketDDP(sync_batchnorm=True)`` is set; it can
    also be passed directly as ``Trainer(plugins=[BucketSyncBatchNorm()])``.
    """

    @override
    def apply(self, model: Module) -> Module:
        """Replace every BatchNorm layer in ``model`` by ``bucketddp.SyncBatchNorm``."""
        return convert_sync_batchnorm(model)

    @override
    def revert(self, model: Module) -> Module:
        """Give every converted layer its original BatchNorm class back."""
        return revert_sync_batchnorm(model)


class BucketDDP(DDPStrategy):
    """Lightning's DDP strategy with bucketddp's gradient reducer and buffer policies.

    ``Trainer(strategy=BucketDDP())`` trains like ``Trainer(strategy="ddp")``, with the same
    launchers and cluster environments (subprocess, spawn, torchrun, SLURM), and gets
    ``BucketDataParallel``'s reducer, a sync policy per buffer and a SyncBatchNorm that
    works on CPU. Outside of fit (validate, test, predict) no wrapper is attached and the
    parameters and buffers are broadcast from rank 0, as with ``DDPStrategy``.

    Args:
        bucket_cap_mb, first_bucket_mb, find_unused_parameters, gradient_as_bucket_view,
        broadcast_buffers, buffer_sync, default_buffer_policy, static_graph, init_sync,
        forward_sync_buffers, check_finite: the engine options, as ``BucketDataParallel``
            takes them; see ``bucketddp.options.EngineOptions`` for each.
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
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``.

    Raises:
        TypeError: a bad engine option (see ``EngineOptions``), or a ``sync_batchnorm``
            other than True or False.
        ValueError: a bad engine option (see ``EngineOptions``), a hook state or wrapper
            without a hook, or a ``model_averaging_period`` that is missing with a
            ``PostLocalSGDState``, given without one, or not a positive integer.
    """

    def __init__(
        self,
        *,
        # The engine options (EngineOptions), ...
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: float | None = 25.0,
        first_bucket_mb: float | None = 1.0,
        gradient_as_bucket_view: bool = True,
        init_sync: bool = True,
        buffer_sync: Mapping[str, Policy] | None = None,
        default_buffer_policy: Policy | None = None,
        broadcast_buffers: bool | None = None,
        forward_sync_buffers: bool | None = None,
        check_finite: bool = False,
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
    ) -> None:
        self._engine_options = EngineOptions.from_arguments(locals(), unused_hint=UNUSED_HINT)
        check_switches(sync_batchnorm=sync_batchnorm)
        self._comm_hook = _comm_hook(ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper)
        _check_averaging(ddp_comm_state, model_averaging_period)
        # Set before DDPStrategy.__init__, which assigns ``_layer_sync`` (our property).
        self._sync_batchnorm = sync_batchnorm
        # DDPStrategy keeps the wrapper's keyword arguments in ``_ddp_kwargs``: ours, checked,
        # for code that reads them there; ``_setup_model`` passes the options themselves.
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
        # The order from a loaded checkpoint, until the wrapper adopts it.
        self._saved_bucket_order: list[str] | None = None
        # The order the last fit learned, for checkpoints saved after fit.
        self._learned_bucket_order: list[str] | None = None

    # ------------------------------------------------------------------ SyncBatchNorm
    # The accelerator connector assigns ``strategy._layer_sync`` after construction: Lightning's
    # TorchSyncBatchNorm for ``Trainer(sync_batchnorm=True)`` and None otherwise. A property
    # lets the strategy put its own plugin in place of the first, and keep
    # ``BucketDDP(sync_batchnorm=True)`` in force over the second.
    @property
    def _layer_sync(self) -> LayerSync | None:
        return self._bucket_layer_sync

    @_layer_sync.setter
    def _layer_sync(self, plugin: LayerSync | None) -> None:
        if type(plugin) is TorchSyncBatchNorm or (plugin is None and self._sync_batchnorm):
            plugin = BucketSyncBatchNorm()
        self._bucket_layer_sync = plugin

    # ------------------------------------------------------------------ process group
    @override
    def setup_distributed(self) -> None:
        existed = dist.is_available() and dist.is_initialized()
        super().setup_distributed()
        if not existed and dist.is_initialized():
            _destroy_at_exit(dist.group.WORLD)

    # ------------------------------------------------------------------- wrapping
    @override
    def _setup_model(self, model: Module) -> BucketDataParallel:  # type: ignore[override]
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
        wrapped = self._setup_model(self.model)
        if self._comm_hook is not None:
            wrapped.register_comm_hook(*self._comm_hook)
        self.model = wrapped
        self._learned_bucket_order = None
        order, self._saved_bucket_order = self._saved_bucket_order, None
        if order is not None:
            _adopt_bucket_order(wrapped, order)

    @property
    def _wrapped(self) -> BucketDataParallel | None:
        return self.model if isinstance(self.model, BucketDataParallel) else None

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
    def on_test_start(self) -> None:
        """Sync buffers by their policies, so every rank tests the same model."""
        self._sync_buffers()
        super().on_test_start()

    @override
    def on_train_end(self) -> None:
        """Sync buffers once more, so the module the user holds after fit agrees."""
        self._sync_buffers()
        super().on_train_end()

    # ---------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict (no wrapper prefix), with buffers synced first.

        Every rank takes part in checkpointing, so the sync is a collective like any other;
        ``"none"`` buffers are written from rank 0's copy, as rank 0 writes the file.
        """
        self._sync_buffers()
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Add the learned bucket order under ``checkpoint["bucketddp"]`` and save on rank 0."""
        wrapped = self._wrapped
        order = wrapped.bucket_order if wrapped is not None else self._learned_bucket_order
        if order is not None:
            checkpoint[CHECKPOINT_KEY] = {"bucket_order": order}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the weights, and the checkpoint's bucket order for the wrapper.

        Lightning loads before ``setup``, so the order is kept until ``configure_ddp`` wraps
        the model; a load into an already wrapped model adopts it at once.
        """
        order = (checkpoint.get(CHECKPOINT_KEY) or {}).get("bucket_order")
        super().load_model_state_dict(checkpoint, strict=strict)
        wrapped = self._wrapped
        if wrapped is None:
            self._saved_bucket_order = order
            return
        # The loaded "sum" buffers are the agreed totals from here on.
        wrapped.buffers_sync.reset_baseline()
        if order is not None:
            _adopt_bucket_order(wrapped, order)

    # -------------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        """Unwrap the model and remove the reducer's hooks, so the user's module is plain;
        DDPStrategy's teardown then reverts SyncBatchNorm and moves the model to CPU."""
        if (wrapped := self._wrapped) is not None:
            self._learned_bucket_order = wrapped.bucket_order
            wrapped.remove_hooks()
            self.model = self.lightning_module
        self._saved_bucket_order = None
        super().teardown()

    # ------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register "bucket_ddp", "bucket_ddp_spawn" and
        "bucket_ddp_find_unused_parameters_true"."""
        entries: list[tuple[str, str, dict[str, Any]]] = [
            ("bucket_ddp", "BucketDDP, processes started as scripts", {}),
            ("bucket_ddp_spawn", "BucketDDP, processes spawned", {"start_method": "spawn"}),
            (
                "bucket_ddp_find_unused_parameters_true",
                "BucketDDP with find_unused_parameters=True",
                {"find_unused_parameters": True},
            ),
        ]
        for name, description, params in entries:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **params)


def _adopt_bucket_order(wrapped: BucketDataParallel, order: list[str]) -> None:
    if wrapped.load_bucket_order(order):
        rank_zero_debug("BucketDDP: restored the learned bucket order from the checkpoint")
    else:
        rank_zero_debug(
            "BucketDDP: the checkpoint's bucket order names other parameters than the model "
            "has; the order is learned again in the first backward pass"
        )


# The default group BucketDDP created in this process, destroyed when the interpreter exits.
# Not at teardown: a later trainer.test() or a new Trainer in the same script reuses the
# group, as with DDPStrategy, and re-creating one over the same address races with ranks
# still holding the old one. A gloo group left alive into interpreter shutdown is what
# makes Lightning runs end in "terminate called without an active exception" (SIGABRT).
_created_group: dist.ProcessGroup | None = None


def _comm_hook(
    hook: Callable[..., Any] | None, state: object | None, wrapper: Callable[..., Any] | None
) -> tuple[object | None, Callable[..., Any]] | None:
    """``(state, hook)`` to register on the wrapper, the wrapper applied; None for no hook.

    Raises:
        ValueError: a state or wrapper without a hook.
    """
    if hook is None:
        if state is not None or wrapper is not None:
            raise ValueError(
                "ddp_comm_state and ddp_comm_wrapper apply to a ddp_comm_hook, and none was "
                "given; pass ddp_comm_hook=..., e.g. default_hooks.fp16_compress_hook"
            )
        return None
    return state, (wrapper(hook) if wrapper is not None else hook)


def _check_averaging(state: object | None, period: int | None) -> None:
    """Post-local SGD needs a model averaging period, and the period needs post-local SGD."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

    local_sgd = isinstance(state, PostLocalSGDState)
    if local_sgd and period is None:
        raise ValueError(
            "ddp_comm_state is a PostLocalSGDState, so the ranks step on local gradients "
            "after start_localSGD_iter; pass model_averaging_period=N to average the "
            "parameters every N steps"
        )
    if period is not None and not local_sgd:
        raise ValueError(
            f"model_averaging_period={period} applies to post-local SGD only; pass "
            "ddp_comm_state=PostLocalSGDState(...) and ddp_comm_hook=post_localSGD_hook"
        )
    if period is not None and (
        isinstance(period, bool) or not isinstance(period, int) or period < 1
    ):
        raise ValueError(f"model_averaging_period must be a positive integer, got {period!r}")


def _destroy_at_exit(group: dist.ProcessGroup | None) -> None:
    global _created_group
    if _created_group is None:
        atexit.register(_destroy_created_group)
    _created_group = group


def _destroy_created_group() -> None:
    global _created_group
    group, _created_group = _created_group, None
    if group is not None and dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()


BucketDDP.register_strategies(StrategyRegistry)
