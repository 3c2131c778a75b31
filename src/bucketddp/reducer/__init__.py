"""The gradient reducer: a small core (``core.py``) and the features that plug into it."""

from .core import Reducer
from .errors import NO_TRAINABLE
from .stats import CommStats

__all__ = ["NO_TRAINABLE", "CommStats", "Reducer"]
