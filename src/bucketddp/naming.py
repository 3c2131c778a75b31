"""How messages list names: the first ten, and how many there are in all beyond that."""

from __future__ import annotations

from collections.abc import Sequence

LIMIT = 10


def first_names(names: Sequence[str], limit: int = LIMIT) -> str:
    """``names`` comma-separated, cut after ``limit``: ``"a, b, ... (12 in all)"``."""
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def name_list(names: Sequence[str], limit: int = LIMIT) -> str:
    """``names`` as a Python list, cut after ``limit``: ``"['a', 'b', '...']"``."""
    return repr([*names[:limit], *(["..."] if len(names) > limit else [])])
