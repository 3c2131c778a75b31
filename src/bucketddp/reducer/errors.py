"""The reducer's error messages: what went wrong, on every rank, and how to fix it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..naming import first_names, name_list

if TYPE_CHECKING:
    from .storage import BucketStorage

NO_TRAINABLE = (
    "BucketDataParallel needs at least one parameter with requires_grad=True, and the module "
    "has none to reduce (those in _ddp_params_and_buffers_to_ignore do not count). Unfreeze "
    "the parameters to train (requires_grad_(True)) before wrapping; a model that only runs "
    "inference needs no wrapper."
)


def twice(name: str) -> str:
    """A parameter got two gradients in one backward."""
    return (
        f"parameter {name!r} received a gradient twice in one backward pass; "
        "bucketddp supports one gradient per parameter per backward (a parameter used "
        "in two reentrant checkpoint segments gets one per segment: pass "
        "use_reentrant=False to torch.utils.checkpoint, or static_graph=True to the "
        "wrapper if the graph is the same every step)"
    )


def create_graph(name: str) -> str:
    """A gradient that carries a graph of its own (``backward(create_graph=True)``)."""
    return (
        f"parameter {name!r} has a gradient that requires grad: backward(create_graph=True) "
        "is not supported, since the bucket all-reduce cannot carry a gradient's own graph "
        "(torch DDP fails here too). For higher-order terms (a gradient penalty, "
        "Hessian-vector products), take them with torch.autograd.grad(..., create_graph=True) "
        "and call backward() on the final loss without create_graph."
    )


def not_strided(name: str, layout: object) -> str:
    """A sparse gradient for a parameter planned as dense."""
    return (
        f"parameter {name!r} has a {layout} gradient, but its module "
        "did not have sparse=True when it was wrapped; set sparse=True on the "
        "nn.Embedding or nn.EmbeddingBag before wrapping (or wrap it again)"
    )


def two_wrappers(name: str) -> str:
    """Two wrappers staged one parameter's gradient in the same backward."""
    return (
        f"parameter {name!r} is reduced by two BucketDataParallel wrappers "
        "in this backward pass: both hold it, and both ran a forward since their last "
        "backward. Reduce each parameter with one wrapper per backward: wrap one "
        "module that holds every part (an nn.ModuleDict, say), or run each wrapper's "
        "forward and backward in turn."
    )


def retyped(name: str, got: object, planned: object) -> str:
    """A gradient whose dtype is not its bucket's."""
    return (
        f"parameter {name!r} now has a {got} gradient, but it was "
        f"{planned} when the module was wrapped and its bucket holds {planned}. "
        "Convert the module (.to(dtype), .double(), .half()) before wrapping it, or "
        "wrap it again after converting."
    )


def missing(names: list[str], hint: str) -> str:
    """Parameters that got no gradient on some rank."""
    return (
        f"BucketDataParallel: parameters {name_list(names)} received no gradient in this backward "
        f"pass on at least one rank, so their gradients cannot be reduced. "
        f"{hint}, or make every parameter contribute to the loss on every rank."
    )


def requires_grad_differs(shown: list[str]) -> str:
    """Parameters frozen on some ranks and not on others (``shown`` with their counts)."""
    return (
        "BucketDataParallel: requires_grad differs between ranks for parameters "
        f"{first_names(shown)} (figures: ranks on which it requires a "
        "gradient). Freeze and unfreeze parameters alike on every rank, before the same "
        "forward."
    )


def module_changed(where: str, what: str) -> str:
    """Modules that gained parameters after wrapping."""
    return (
        f"BucketDataParallel: the wrapped module gained parameters after wrapping, {where} "
        f"{what}. The wrapper reduces the Parameter objects the module held when it was "
        "wrapped, so a new one would train on each rank's own gradient. Add or replace layers, "
        "call load_state_dict(assign=True) or apply weight_norm before wrapping, or wrap "
        "the module again afterwards; to load weights into a wrapped module, use "
        "load_state_dict without assign=True, which copies in place."
    )


def sparse_joined(names: list[str]) -> str:
    """Sparse parameters unfrozen after wrapping."""
    return (
        f"parameters {first_names(names)} have sparse gradients and became "
        "trainable after the model was wrapped; bucketddp plans sparse parameters when "
        "it wraps the model. Unfreeze them before wrapping, or wrap the model again "
        "after unfreezing them."
    )


def hook_with_sparse(names: list[str]) -> str:
    """A communication hook on a model with sparse gradients."""
    return (
        f"register_comm_hook: parameters {first_names(names)} have sparse gradients "
        "(sparse=True), which bucketddp all-reduces itself; communication hooks are "
        "supported for dense gradients only. Build the embeddings with sparse=False to "
        "use a hook."
    )


def check_gradient(
    name: str, grad: torch.Tensor, slot: torch.Tensor, storage: BucketStorage
) -> None:
    """Raise if ``grad`` cannot be staged in ``slot``: not strided, reduced twice, retyped."""
    if grad.layout != torch.strided:
        raise RuntimeError(not_strided(name, grad.layout))
    if grad._base is not None and storage.staged_by_other(grad._base):
        raise RuntimeError(two_wrappers(name))
    if grad.dtype != slot.dtype:
        raise RuntimeError(retyped(name, grad.dtype, slot.dtype))


def non_finite(found: list[tuple[int, int, list[str]]]) -> str:
    """Gradients with NaN or Inf: per rank, (rank, how many parameters, the first names)."""
    parts = [
        f"rank {rank} in {name_list(names)}"
        + (f" and {count - len(names)} more" if count > len(names) else "")
        for rank, count, names in found
    ]
    return (
        f"BucketDataParallel: gradients with NaN or Inf values on {'; '.join(parts)} "
        "(check_finite=True). They were found before averaging, and every rank raises here, "
        "so no optimizer step takes them in. Look for the cause on those ranks (the loss, "
        "the batch, the learning rate); to go on, call optimizer.zero_grad() and skip the "
        "step."
    )
