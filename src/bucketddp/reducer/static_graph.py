"""``static_graph=True``: torch DDP's promise that the graph is the same every step.

A parameter may then get several gradients in one backward (a layer shared by reentrant
checkpoint segments). The first synced backward counts them and reduces everything at its
end, without overlap; later ones stage a parameter at its last gradient, so buckets
launch during backward again. Parameters that get no gradient are allowed, as with
``find_unused_parameters``.
"""

from __future__ import annotations

import torch

from .state import ReducerState


class StaticGraph:
    """Counts each parameter's gradients per backward; hands the last one to the core."""

    def __init__(self, reducer: ReducerState) -> None:
        self._r = reducer
        self.fires = [0] * len(reducer.params)
        # How many gradients per parameter the first synced backward counted.
        self.expected: list[int] | None = None

    def autograd_hook(self, i: int, param: torch.Tensor) -> None:
        """Act on parameter ``i``'s last gradient of the backward.

        Until the first synced backward has counted them, and inside ``no_sync``, only the
        first gradient is recorded; ``before_reduce`` then stages the slots from ``.grad``.
        """
        r = self._r
        if not r.expecting_backward:
            return
        fires = self.fires[i] = self.fires[i] + 1
        expected = self.expected
        if expected is None or not r.sync_step:
            if fires == 1:
                r.mark_variable_ready(i)
            return
        if fires < expected[i]:
            if fires == 1:  # used, even if its last gradient never comes (reduced at the end)
                r.used_not_ready(i)
            return
        if fires > expected[i]:
            raise RuntimeError(
                f"parameter {r.names[i]!r} received {fires} gradients in this backward "
                f"pass, but {expected[i]} in the first one; static_graph=True needs the same "
                "graph every step. Pass static_graph=False (and use_reentrant=False to "
                "torch.utils.checkpoint if a parameter is used in several segments)."
            )
        r.gradient_hooks[i](i, param)

    def before_reduce(self) -> None:
        """First synced backward: stage every gradient now, and keep the counts.

        Its hooks only counted gradients, since a parameter's last one could not be told
        apart from the others until the end.
        """
        if self.expected is not None:
            return
        r = self._r
        for i, p in enumerate(r.params):
            if not r.ready[i]:
                continue
            if i in r.unslotted:
                r.mark_bucket_ready(r.bucket_of[i])
            else:
                r.stage(i, p)
        self.expected = list(self.fires)

    def reset(self) -> None:
        """A new backward: no gradient counted yet."""
        self.fires = [0] * len(self.fires)
