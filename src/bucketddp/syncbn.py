"""SyncBatchNorm: BatchNorm with statistics over a whole process group, on any backend.

In training each rank reduces its batch to per-channel sums, and one all-reduce turns them
into the mean and variance of the global batch. The input gradient needs two more sums per
channel over the global batch, which take one all-reduce in backward. Only
``torch.distributed`` collectives are used, so the same code runs over gloo (CPU) and NCCL
(GPU); torch's own ``nn.SyncBatchNorm`` refuses CPU input in training.

``convert_sync_batchnorm`` and ``revert_sync_batchnorm`` swap layers in both directions. A
converted layer remembers the class it came from, so the revert restores it exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from .comm import private_copy
from .faults.progress import COLLECTIVE, PROGRESS

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm"]

BN = TypeVar("BN", bound=_BatchNorm)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the batch across a process group.

    Takes the arguments of ``torch.nn.SyncBatchNorm`` and accepts inputs of shape
    ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``. Forward outputs,
    gradients and running statistics equal those of one BatchNorm applied to the
    concatenation of all ranks' batches, whatever the per-rank batch sizes (an empty batch
    on some rank included). Each layer costs one all-reduce in forward and one in backward.
    Without an initialized process group, with a group of one rank, and in eval mode it is
    plain BatchNorm and does no communication (so in eval, a layer without running
    statistics normalizes by the local batch's, like torch's SyncBatchNorm).

    Every rank of the group must run forward and backward through the layer, in the same
    order as the other ranks: the collectives inside are matched by order.

    Args:
        num_features: the number of channels ``C``.
        eps: added to the variance for numerical stability.
        momentum: the running-statistics update factor; None for a cumulative average.
        affine: whether the layer has a learnable per-channel weight and bias.
        track_running_stats: whether the layer keeps running mean and variance buffers.
        process_group: the ranks whose batches are normalized together; the default
            group if None.
        device: where to create the parameters and buffers.
        dtype: the dtype of the parameters and buffers.
        bias: with ``affine``, whether the layer has a bias (torch versions that support it).

    Attributes:
        converted_from: the class ``convert_sync_batchnorm`` replaced with this layer;
            the layer keeps that class's input-dimension check, and
            ``revert_sync_batchnorm`` restores it. None for a layer built directly.
    """

    # The running statistics come from global batch statistics, so they are already equal
    # on every rank: buffer sync in BucketDataParallel need not touch them (see buffers.py).
    default_buffer_policy = "none"

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        # Passed only when off, so that torch versions without the argument still work.
        extra: dict[str, Any] = {} if bias else {"bias": False}
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device, dtype, **extra
        )
        self.process_group = process_group
        self.converted_from: type[_BatchNorm] | None = None

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"{type(self).__name__} expected input of shape (N, C, ...) with at least 2 "
                f"dimensions, got {input.dim()}D input of shape {tuple(input.shape)}"
            )
        # A converted layer keeps the stricter check of its original class
        # (BatchNorm2d accepts only 4D input, and so on).
        origin = self.converted_from
        if origin is not None and origin._check_input_dim is not _BatchNorm._check_input_dim:
            origin._check_input_dim(self, input)

    def _group_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        size = dist.get_world_size(self.process_group)
        if size < 1:
            raise RuntimeError(
                f"rank {dist.get_rank()} is not a member of the process_group of this "
                "SyncBatchNorm; give each rank's layers a group that contains that rank "
                "(torch.distributed.new_group() must be called on every rank)"
            )
        return size

    def forward(self, input: Tensor) -> Tensor:
        """Normalize with global batch statistics in training, running statistics in eval."""
        self._check_input_dim(input)

        # These decisions follow torch's _BatchNorm.forward, so that momentum=None,
        # track_running_stats=False and eval mode mean exactly what they mean there.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if self.training:
            use_batch_stats = True
        else:
            use_batch_stats = self.running_mean is None and self.running_var is None
        use_buffers = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_buffers else None
        running_var = self.running_var if use_buffers else None

        # Eval never communicates, as in torch's SyncBatchNorm: evaluation often runs on a
        # subset of ranks. Without running statistics eval therefore uses the local batch's.
        if not self.training or self._group_size() == 1:
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                use_batch_stats,
                factor,
                self.eps,
            )

        mean, var, count = _global_batch_stats(input, self.process_group)
        # The global count stays on the device (no host sync per layer on GPUs) unless this
        # rank's batch is too small to rule out a global batch of 0 or 1 values per channel.
        if input.numel() <= input.shape[1]:
            total = round(count.item())
            if total == 0:
                # Every rank's batch is empty: BatchNorm returns an empty output and leaves
                # the running statistics alone; no rank has anything to reduce in backward.
                return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
            if total == 1:
                raise ValueError(
                    "Expected more than 1 value per channel when training, got 1 across the "
                    f"process group (input of shape {tuple(input.shape)} on rank "
                    f"{dist.get_rank()}); use larger batches or call .eval()"
                )
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        out: Tensor = _SyncBatchNormFn.apply(
            input, self.weight, self.bias, mean, var, self.eps, count, self.process_group
        )
        return out


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision inputs are reduced and normalized in float32; float64 stays float64.
    return torch.promote_types(dtype, torch.float32)


def _per_channel(t: Tensor, ndim: int) -> Tensor:
    return t.view(1, -1, *([1] * (ndim - 2)))


def _reduce_dims(ndim: int) -> list[int]:
    return [0, *range(2, ndim)]


@torch.no_grad()
def _global_batch_stats(
    input: Tensor, group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-channel mean and biased variance of the group's whole batch, and its size.

    One all-reduce of ``[sum, sum of squares, count]`` in float64. Each rank first takes
    its own mean and squared deviations in two passes (sum, then deviations from the mean),
    which is both accurate and fast; only the combination ``E[x^2] - mean^2`` runs on the
    sums, in float64, where it keeps about ``16 - 2*log10(|mean|/std)`` significant digits,
    far more than a float32 result needs. The count is returned as a float64 scalar tensor
    on the input's device.
    """
    channels = input.shape[1]
    count = input.numel() // channels if channels else 0
    cdtype = _compute_dtype(input.dtype)
    packed = torch.zeros(2 * channels + 1, dtype=torch.float64, device=input.device)
    if count > 0:
        # An empty batch contributes zeros, but its rank still joins the collective.
        dims = _reduce_dims(input.dim())
        x = input.to(cdtype)
        rough_mean = x.sum(dims) / count
        dev = x - _per_channel(rough_mean, input.dim())
        dev_sum = dev.sum(dims).double()  # what rounding left of the mean: a tiny correction
        m2 = dev.square_().sum(dims).double() - dev_sum * dev_sum / count
        mean = rough_mean.double() + dev_sum / count
        packed[:channels] = mean * count
        packed[channels:-1] = m2.clamp_(min=0.0) + mean * mean * count
        packed[-1] = count
    with PROGRESS.during(COLLECTIVE, "SyncBatchNorm statistics"):
        dist.all_reduce(packed, group=group)
    total = packed[-1]
    mean_g = packed[:channels] / total.clamp(min=1)
    var_g = (packed[channels:-1] / total.clamp(min=1) - mean_g * mean_g).clamp_(min=0.0)
    return mean_g.to(cdtype), var_g.to(cdtype), total


class _SyncBatchNormFn(torch.autograd.Function):
    """Normalization by given global statistics; its backward reduces over the group."""

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        mean: Tensor,
        var: Tensor,
        eps: float,
        count: Tensor,
        group: dist.ProcessGroup | None,
    ) -> Tensor:
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(input, weight, mean, invstd, count)
        ctx.group = group
        ctx.bias_dtype = None if bias is None else bias.dtype
        # BatchNorm's eval form with the global statistics standing in for the running ones:
        # one fused kernel on every backend. Its kernels take half-precision input only with
        # statistics and parameters all in float32, hence the (per-channel, cheap) casts.
        cdtype = mean.dtype
        w = None if weight is None else weight.to(cdtype)
        b = None if bias is None else bias.to(cdtype)
        return F.batch_norm(input, mean, var, w, b, False, 0.0, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        input, weight, mean, invstd, count = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        ndim = input.dim()
        dims = _reduce_dims(ndim)
        cdtype = mean.dtype

        dy = grad_out.to(cdtype)
        xmu = input.to(cdtype) - _per_channel(mean, ndim)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        # Parameter gradients stay local sums, like any parameter's: the data-parallel
        # wrapper reduces them across ranks with the rest.
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if need_weight else None
        grad_bias = sum_dy.to(ctx.bias_dtype) if need_bias else None
        if not need_input:
            return None, grad_weight, grad_bias, None, None, None, None, None

        sums = torch.cat([sum_dy, sum_dy_xmu])
        with PROGRESS.during(COLLECTIVE, "SyncBatchNorm backward"):
            dist.all_reduce(sums, group=ctx.group)
        channels = mean.numel()
        mean_dy = sums[:channels] / count.to(cdtype)
        mean_dy_xmu = sums[channels:] / count.to(cdtype)

        # dx = scale * (dy - mean(dy) - xhat * mean(dy * xhat)), xhat = (x - mean) * invstd
        # and scale = weight * invstd; computed per element as xmu * a + c + dy * scale,
        # in place in xmu, which this function allocated.
        scale = invstd if weight is None else invstd * weight.to(cdtype)
        a = -scale * invstd * invstd * mean_dy_xmu
        c = -scale * mean_dy
        grad_input = xmu.mul_(_per_channel(a, ndim)).add_(_per_channel(c, ndim))
        grad_input.addcmul_(dy, _per_channel(scale, ndim))
        return grad_input.to(input.dtype), grad_weight, grad_bias, None, None, None, None, None


def syncbn_layers(module: nn.Module) -> list[str]:
    """The names of the SyncBatchNorm layers (ours or torch's) in ``module``.

    They all-reduce inside forward and backward, so other code that communicates must keep
    one order with them on every rank.
    """
    return [name or type(m).__name__ for name, m in _sync_layers(module)]


def _sync_layers(module: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """``module``'s SyncBatchNorm layers, ours and torch's, with their names."""
    return [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, (SyncBatchNorm, nn.SyncBatchNorm))
    ]


def separate_group(module: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Move ``module``'s SyncBatchNorm layers that normalize over ``group`` to a copy of it.

    A communication hook may launch collectives from another thread (PowerSGD does, from
    its futures' callbacks; bucketddp calls a bucket's hook from the previous bucket's
    future). On the group the layers' blocking all-reduces use, the ranks could then issue
    the two in different orders, a collective mismatch. A private group with the same
    ranks keeps the layers' collectives apart. ``group`` None means the default group.
    Every rank of the group must call this, at the same point. Returns how many layers
    moved.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    world = dist.group.WORLD
    base = group if group is not None else world
    layers = [
        m
        for _, m in _sync_layers(module)
        if (m.process_group if m.process_group is not None else world) is base
    ]
    if layers:
        private = private_copy(base)
        for m in layers:
            m.process_group = private  # type: ignore[assignment]  # nn.Module's attribute typing
    return len(layers)


def _rebuild_as(module: _BatchNorm, cls: type[BN]) -> BN:
    """A ``cls`` instance carrying ``module``'s whole state: the same Parameter and buffer
    objects, requires_grad, training flag, hooks and any attributes of its own.

    The hook registries are the same dicts, so that a handle taken before (from
    ``register_forward_hook``, say) still removes its hook. The other registries
    (parameters, buffers, submodules) are copied one level deep.
    """
    new = cls.__new__(cls)
    for key, value in module.__dict__.items():
        shared = "hooks" in key or not isinstance(value, (dict, set))
        new.__dict__[key] = value if shared else copy.copy(value)
    return new


def convert_sync_batchnorm(
    module: nn.Module, process_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` by a ``bucketddp.SyncBatchNorm``.

    BatchNorm1d/2d/3d, their subclasses and ``torch.nn.SyncBatchNorm`` are replaced; the new
    layers share the old ones' parameters and buffers and remember their original class
    (see ``revert_sync_batchnorm``). ``module`` is changed in place.

    Args:
        module: the model, or a single BatchNorm layer.
        process_group: the group the new layers normalize over; None keeps the group of a
            ``torch.nn.SyncBatchNorm`` layer and means the default group otherwise.

    Returns:
        ``module``, or its replacement when ``module`` itself is a BatchNorm layer.

    Raises:
        ValueError: a lazy BatchNorm layer whose parameters are not materialized yet.
    """
    return _convert(module, process_group, prefix="", memo={})


def _replace_children(
    module: nn.Module, swap: Callable[[nn.Module, str], nn.Module], memo: dict[int, nn.Module]
) -> None:
    """Replace each child of ``module`` by ``swap(child, name)``, once per child object.

    A child registered under several names (one BatchNorm applied twice) is swapped once
    and its replacement put under every name, so the names keep sharing one layer.
    """
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        if id(child) not in memo:
            memo[id(child)] = swap(child, name)
        if memo[id(child)] is not child:
            module.add_module(name, memo[id(child)])


def _convert(
    module: nn.Module, group: dist.ProcessGroup | None, prefix: str, memo: dict[int, nn.Module]
) -> nn.Module:
    if isinstance(module, SyncBatchNorm):
        if group is not None:
            module.process_group = group
        return module
    if isinstance(module, _BatchNorm):
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(
                f"cannot convert {prefix or 'the module'} ({type(module).__name__}): its "
                "parameters are not materialized yet; run one forward pass before "
                "convert_sync_batchnorm"
            )
        origin = type(module)
        keep_group = group is None and isinstance(module, nn.SyncBatchNorm)
        new = _rebuild_as(module, SyncBatchNorm)
        new.process_group = getattr(module, "process_group", None) if keep_group else group
        new.converted_from = origin
        return new
    _replace_children(
        module,
        lambda child, name: _convert(child, group, f"{prefix}.{name}" if prefix else name, memo),
        memo,
    )
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``bucketddp.SyncBatchNorm`` in ``module`` by its original class.

    The inverse of ``convert_sync_batchnorm``: each layer gets back the class it was
    converted from (BatchNorm1d/2d/3d, a subclass, or ``torch.nn.SyncBatchNorm`` with its
    process group), with the same parameters, buffers, training flag and dimension check,
    so ``state_dict()`` is unchanged. A layer built directly as ``SyncBatchNorm`` was not
    converted, so it stays as it is. ``module`` is changed in place.

    Returns:
        ``module``, or its replacement when ``module`` itself is a converted SyncBatchNorm.
    """
    return _revert(module, memo={})


def _revert(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    if isinstance(module, SyncBatchNorm):
        origin = module.converted_from
        if origin is None:
            return module
        new = _rebuild_as(module, origin)
        del new.__dict__["converted_from"]
        if not issubclass(origin, nn.SyncBatchNorm):
            del new.__dict__["process_group"]
        return new
    _replace_children(module, lambda child, _: _revert(child, memo), memo)
    return module
