"""What the wrapper checks and reads of a module before wrapping it.

Pure functions of the module: no process groups, no collectives.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable, Sequence

from torch import nn

from .comm import IGNORED_KIND
from .naming import name_list


def check_wrappable(module: object, ours: type) -> None:
    """Raise unless ``module`` is an ``nn.Module`` with no data-parallel wrapper inside it.

    ``ours`` is this package's wrapper class; torch DDP's is checked too.

    A wrapper inside (the module itself, or a submodule) would reduce its parameters'
    gradients a second time. torch DDP does not check this.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: naming the wrapper found and what to wrap instead.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"BucketDataParallel wraps an nn.Module, got {type(module).__name__}")
    wrappers = (ours, nn.parallel.DistributedDataParallel)
    for name, sub in module.named_modules():
        if isinstance(sub, wrappers):
            where = f"its submodule {name!r} is" if name else "it is already"
            raise ValueError(
                f"cannot wrap this module: {where} a {type(sub).__name__}, whose hooks "
                "already reduce those gradients, so they would be reduced twice. Wrap the "
                "plain model once: pass wrapper.module instead of the wrapper."
            )


def check_initialized(module: nn.Module) -> None:
    """Raise if ``module`` has parameters or buffers without data yet.

    Lazy ones (``nn.LazyLinear`` and kin) have no shape before the first forward; meta ones
    (built under ``torch.device("meta")``) have no storage. Neither can be compared across
    ranks, broadcast or bucketed.

    Raises:
        RuntimeError: naming them and what to do.
    """
    tensors = [*module.named_parameters(), *module.named_buffers()]
    lazy = [n for n, t in tensors if nn.parameter.is_lazy(t)]
    if lazy:
        raise RuntimeError(
            f"the module's parameters or buffers {name_list(lazy)} are not initialized yet (a lazy "
            "module such as nn.LazyLinear): run one forward pass on a batch first, so that "
            "they get their shapes, then wrap the module"
        )
    meta = [n for n, t in tensors if t.is_meta]
    if meta:
        raise RuntimeError(
            f"the module's parameters or buffers {name_list(meta)} are on the meta device and hold "
            "no data: materialize them first (module.to_empty(device=...), then initialize "
            "or load the weights), then wrap the module"
        )


def ignored_names(module: nn.Module) -> frozenset[str]:
    """The names in ``module._ddp_params_and_buffers_to_ignore``, torch DDP's ignore list.

    Warns about names that are neither a parameter nor a buffer of the module: they ignore
    nothing, so what the user meant to keep rank-local would be synchronized.

    Raises:
        TypeError: the attribute is a single string rather than a collection of names.
    """
    names = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
    if names is None:
        return frozenset()
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(
            f"_ddp_params_and_buffers_to_ignore is {names!r}; set it to a list of "
            "parameter and buffer names, e.g. ['head.weight', 'bn.running_mean']"
        )
    ignored = frozenset(names)
    known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    unknown = sorted(ignored - known)
    if unknown:
        warnings.warn(
            f"_ddp_params_and_buffers_to_ignore lists {name_list(unknown)}, which name no "
            "parameter or buffer of the module, so they ignore nothing; use the names of "
            "named_parameters() and named_buffers(), e.g. 'layer.0.weight'",
            stacklevel=3,
        )
    return ignored


def set_ignored(module: nn.Module, params_and_buffers_to_ignore: Collection[str]) -> None:
    """Make a wrapper built later leave these parameters and buffers alone (torch DDP's API).

    Sets ``module._ddp_params_and_buffers_to_ignore``, the attribute both this wrapper and
    torch DDP read. Names are those of ``named_parameters()`` and ``named_buffers()``; see
    ``docs/ignored-parameters.md``.
    """
    module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore  # type: ignore[assignment]


def model_signature(
    module: nn.Module, ignored: frozenset[str]
) -> list[tuple[str, str, tuple[int, ...], str]]:
    """What must agree across ranks: the synced parameters and buffers, and the ignore list.

    Ignored parameters and buffers may differ between ranks (torch DDP skips them too), but
    every rank must ignore the same names, or the ranks would plan different buckets.
    """
    sig = [
        ("parameter" if p.requires_grad else "frozen parameter", n, tuple(p.shape), str(p.dtype))
        for n, p in module.named_parameters()
        if n not in ignored
    ]
    sig += [
        ("buffer", n, tuple(b.shape), str(b.dtype))
        for n, b in module.named_buffers()
        if n not in ignored
    ]
    sig += [(IGNORED_KIND, n, (), "") for n in sorted(ignored)]
    return sig


def sparse_parameters(module: nn.Module) -> list[str]:
    """Names of the parameters whose gradients are sparse: embeddings with ``sparse=True``."""
    ids = {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }
    return [n for n, p in module.named_parameters() if id(p) in ids]


def parameter_changes(
    names: Sequence[str],
    params: Sequence[nn.Parameter],
    current: Sequence[tuple[str, nn.Parameter]],
) -> tuple[list[tuple[str, nn.Parameter]], list[str]]:
    """The ``current`` parameters that are not among ``params``, and the names of those gone.

    Compares ``Parameter`` objects, not names: a layer replaced under the same name brings
    new objects.
    """
    known = {id(p) for p in params}
    now = {id(p) for _, p in current}
    added = [(n, p) for n, p in current if id(p) not in known]
    removed = [n for n, p in zip(names, params, strict=True) if id(p) not in now]
    return added, removed
