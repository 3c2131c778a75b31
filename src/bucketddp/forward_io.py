"""A forward's inputs and outputs, walked through their containers.

Inputs are moved to the module's device (``device_ids``); outputs get the reducer's hook,
which marks where the backward pass starts.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch


def hook_outputs(obj: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """Register ``hook`` on every tensor in ``obj`` that this forward computed with autograd.

    Walks tuples, lists, dict values and dataclass fields, as torch DDP does to find a
    forward's outputs. Leaves (a parameter returned as it is) are skipped: a hook on one
    would outlive the step and pile up, one more per forward.
    """
    if isinstance(obj, torch.Tensor):
        if obj.grad_fn is not None:
            obj.register_hook(hook)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            hook_outputs(x, hook)
    elif isinstance(obj, dict):
        for x in obj.values():
            hook_outputs(x, hook)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            hook_outputs(getattr(obj, f.name), hook)


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor moved to ``device``, through tuples, lists and dicts.

    Containers keep their class (namedtuples included); anything else is returned as is.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        moved = [to_device(x, device) for x in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    if isinstance(obj, list):
        return [to_device(x, device) for x in obj]
    if isinstance(obj, dict):
        out = obj.copy()  # OrderedDict and defaultdict keep their class
        for k, v in obj.items():
            out[k] = to_device(v, device)
        return out
    return obj


_NOT_REDUCED = (
    "BucketDataParallel does not reduce gradients computed with torch.distributed.autograd: "
)
_LOCAL = "would leave each rank's gradients local, unaveraged. Use "
_USE_DDP = "torch.nn.parallel.DistributedDataParallel for distributed autograd, or "


def _rpc_active() -> bool:
    rpc = sys.modules.get("torch.distributed.rpc")
    return rpc is not None and rpc.is_available() and rpc.api._is_current_rpc_agent_set()


def refuse_dist_autograd() -> None:
    """Raise inside a ``torch.distributed.autograd`` context (RPC): not supported.

    ``dist_autograd.backward`` writes gradients into its context, not ``.grad``, and runs
    no parameter hook, so the reducer would leave them local where torch DDP averages them.
    Costs a dictionary lookup where RPC was never imported.

    Raises:
        NotImplementedError: naming what to use instead.
    """
    if not _rpc_active():
        return
    from torch.distributed import autograd as dist_autograd

    try:
        dist_autograd._current_context()
    except RuntimeError:  # no context: a plain backward follows
        return
    raise NotImplementedError(
        f"{_NOT_REDUCED}this forward runs inside dist_autograd.context(), and "
        f"dist_autograd.backward() {_LOCAL}{_USE_DDP}run the forward outside the context "
        "and call loss.backward()."
    )


def output_hook(hook: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``hook`` (the reducer's hook on a forward's outputs), refusing distributed autograd.

    A forward outside ``dist_autograd.context()`` passes :func:`refuse_dist_autograd`, but
    ``dist_autograd.backward(ctx, [loss])`` may still follow inside one. Its engine runs
    this hook (and no parameter hook) on a thread of its own, where no autograd node is
    current, unlike the local engine. Guarded only while RPC is on.

    Raises:
        NotImplementedError: in that backward. Distributed autograd's engine reports it as
            "python_error" alone, so the message goes to stderr as well.
    """
    if not _rpc_active():
        return hook

    def guarded(grad: torch.Tensor) -> None:
        if torch._C._current_autograd_node() is None:
            message = (
                f"{_NOT_REDUCED}dist_autograd.backward() runs through this wrapper's output "
                f"and {_LOCAL}{_USE_DDP}call loss.backward() instead."
            )
            print(f"bucketddp: {message}", file=sys.stderr, flush=True)
            raise NotImplementedError(message)
        hook(grad)

    return guarded
