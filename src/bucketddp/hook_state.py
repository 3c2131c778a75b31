"""A communication hook's state in snapshots: what is kept, per rank or shared, and put back.

A stateful hook carries what the next step needs. PowerSGD's ``PowerSGDState`` holds:

- values every rank has alike: the iteration count (which decides when compression starts),
  the NumPy generator that seeds the low-rank matrices (every rank must draw the same ones),
  and the compression statistics;
- values of this rank alone: the error feedback per bucket (what compression dropped from
  this rank's gradients) and the warm-start memories of the low-rank factors.

``capture`` splits a hook's state that way; the shared part travels in the snapshot's state,
the per-rank part in the rank's own part, which is restored only to the rank that wrote it
and only at the same world size. At another world size ``restore`` keeps the shared part,
starts the per-rank part afresh (zero error feedback, new memories: what PowerSGD does at
its first compressed step) and warns once.

A state of another type takes part through ``state_dict()`` and ``load_state_dict()``: what
it returns is kept per rank. Any other state (``None`` or a process group, as the default
hooks take) holds nothing to keep.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

PER_RANK = ("error_dict", "p_memory_dict", "q_memory_dict")
SHARED = (
    "iter",
    "total_numel_before_compression",
    "total_numel_after_compression",
    "next_stats_report",
)


def _powersgd_type() -> Any:
    try:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    except ImportError:  # a torch build without distributed algorithms
        return None
    return PowerSGDState


def _rng_state(rng: np.random.RandomState) -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = rng.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    return {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }


def _set_rng(rng: np.random.RandomState, saved: dict[str, Any]) -> None:
    keys = saved["keys"].numpy().astype(np.uint32)
    rng.set_state((saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached"]))


def capture(state: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``state``'s (shared, per-rank) parts, or None for a part it does not have.

    Tensors are the hook's own: a snapshot copies them before the next step changes them.
    """
    powersgd = _powersgd_type()
    if powersgd is not None and isinstance(state, powersgd):
        shared = {name: getattr(state, name) for name in SHARED}
        shared["rng"] = _rng_state(state.rng)
        own = {name: dict(getattr(state, name)) for name in PER_RANK}
        return shared, own
    if callable(getattr(state, "state_dict", None)) and callable(
        getattr(state, "load_state_dict", None)
    ):
        return None, {"state_dict": state.state_dict()}
    return None, None


def restore(
    state: Any, shared: dict[str, Any] | None, own: dict[str, Any] | None, *, had_own: bool
) -> None:
    """Put ``capture``'s parts back into ``state``.

    ``own`` is None when this rank's part cannot be had (another world size); ``had_own``
    says whether the snapshot held one, and then a warning says what starts afresh.
    """
    powersgd = _powersgd_type()
    if powersgd is not None and isinstance(state, powersgd):
        if shared is not None:
            for name in SHARED:
                setattr(state, name, shared[name])
            _set_rng(state.rng, shared["rng"])
        for name in PER_RANK:
            getattr(state, name).clear()
            if own is not None:
                getattr(state, name).update(own[name])
    elif own is not None and "state_dict" in own:
        state.load_state_dict(own["state_dict"])
    if own is None and had_own:
        warnings.warn(
            f"bucketddp: the communication hook's per-rank state ({type(state).__name__}: "
            "for PowerSGD, the error feedback and warm-start memories) was not restored: the "
            "world size changed since the snapshot. It starts afresh; the iteration count "
            "and the shared generator are kept.",
            stacklevel=2,
        )
