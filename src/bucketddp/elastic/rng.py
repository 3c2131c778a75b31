"""A process's random number generators, captured and restored with each snapshot."""

from __future__ import annotations

import random
import sys
from array import array
from typing import Any

import torch


def capture() -> dict[str, Any]:
    """The state of Python's, torch's (CPU and each initialized CUDA device) and, if
    imported, NumPy's global generators."""
    version, internal, gauss = random.getstate()
    # Python's state as bytes: its 625 numbers would each cost a call to a pickler's hooks.
    python = (version, array("Q", internal).tobytes(), gauss)
    state: dict[str, Any] = {"python": python, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if (numpy := sys.modules.get("numpy")) is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def restore(state: dict[str, Any]) -> None:
    """Set the generators ``capture`` recorded."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(array("Q", internal)), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
