"""``check_finite=True``: NaN or Inf in a gradient stops the step on every rank, named.

Each bucket is checked just before it is launched, while it still holds this rank's own
gradients. On an accelerator, one fused kernel per bucket takes a figure per parameter (its
L1 norm), left on the device: reading it back would stall the backward. On the CPU, where
reading costs nothing, the bucket is summed, and only a non-finite sum is looked at
parameter by parameter. Just before the last bucket goes, the figures say which planned
parameters hold a NaN or an Inf here, and this rank writes into its own slots of the
agreement row how many, and the first few of them. The row is summed with the last
bucket, so every rank reads every rank's slots: no collective of its own, and nothing read
from the device on the way. A slot that is not zero takes the step off the row's fast
path, and every rank raises the same error, naming the ranks and the parameters
(``agreement.check``).

A rank's slots hold its count of parameters with NaN or Inf, then its first ``NAMED`` of
them, each written as digits small enough for the row's dtype to hold exactly (below 256
in bfloat16). A sum is also non-finite when finite values add up past the dtype's range
(about 3.4e38 in float32; half-precision buckets are summed in float32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import errors
from .state import ReducerState
from .storage import Bucket

NAMED = 3
"""How many parameters the error names per rank: its first ones, in registration order."""
ON_HOST = frozenset({"cpu"})
"""Device types whose values the check reads as it goes: nothing to wait for there."""


def _sum(t: torch.Tensor) -> torch.Tensor:
    """``t``'s sum, half precision in float32: non-finite if ``t`` holds a NaN or an Inf."""
    return t.sum(dtype=torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None)


def param_sums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One 0-dim figure per tensor of one dtype and device, non-finite where it holds NaN or Inf.

    On the CPU a sum each; on an accelerator one fused kernel for all, their L1 norms
    (a launch per tensor would cost more there than the arithmetic).
    """
    if not tensors or tensors[0].device.type in ON_HOST:
        return [_sum(t) for t in tensors]
    half = tensors[0].dtype in (torch.float16, torch.bfloat16)
    return list(torch._foreach_norm(tensors, 1, dtype=torch.float32 if half else None))


def exact_base(dtype: torch.dtype) -> int:
    """The base of the digits a slot of ``dtype`` holds exactly (256 in bfloat16)."""
    real = dtype.to_real() if dtype.is_complex else dtype
    return min(int(2 / torch.finfo(real).eps), 2**24)


class FiniteCheck:
    """Finds NaN and Inf in each bucket before launch; reports in this rank's row slots."""

    def __init__(self, reducer: ReducerState) -> None:
        self._r = reducer
        self.per_rank = 0  # row slots per rank
        self._base = 2
        self._digits = 1
        self._named = 0
        self._on_host = True
        # Per bucket, this step: a figure per parameter, or None (on the host: all finite).
        self._sums: list[list[torch.Tensor] | None] = []
        self._finite: list[list[torch.Tensor]] = []  # per bucket: zeros, a stand-in for None
        # Per planned parameter in launch order, n - its index: the largest are the first.
        self._first_key = torch.empty(0, dtype=torch.int64)
        self._powers = torch.ones(1, dtype=torch.int64)

    def row_slots(self, dtype: torch.dtype, planned: int) -> int:
        """How many row slots the check needs, every rank's, in a last bucket of ``dtype``."""
        self._base = exact_base(dtype)
        self._digits = 1
        while self._base**self._digits <= planned:
            self._digits += 1
        self._named = min(NAMED, planned)
        self.per_rank = (1 + self._named) * self._digits
        return self.per_rank * self._r.world_size

    def install(self) -> None:
        """Take the buckets of a new plan (after ``row_slots`` sized its row)."""
        r = self._r
        order = [i for b in r.buckets for i in b.members]
        device = r.device
        n = len(r.params)
        self._first_key = torch.tensor([n - i for i in order], dtype=torch.int64, device=device)
        powers = [self._base**j for j in range(self._digits)]
        self._powers = torch.tensor(powers, dtype=torch.int64, device=device)
        self._named = min(self._named, len(order))
        self._on_host = device.type in ON_HOST
        self._sums = [None for _ in r.buckets]
        zero = torch.zeros((), device=device)
        self._finite = [[zero] * len(b.members) for b in r.buckets]

    def before_launch(self, k: int, bucket: Bucket) -> None:
        """Check bucket ``k``'s gradients, still this rank's; at the last, write the row."""
        if self._on_host and bool(torch.isfinite(_sum(bucket.grads))):
            self._sums[k] = None
        else:
            views = self._r.views
            self._sums[k] = param_sums([views[i] for i in bucket.members])
        if bucket.row is not None:
            self._write()

    def _write(self) -> None:
        """This rank's slots: how many parameters have NaN or Inf, and the first of them."""
        if not self._named or (self._on_host and all(s is None for s in self._sums)):
            return  # nothing slotted (sparse gradients only), or all finite: the slots are 0
        figures = [s if s is not None else self._finite[k] for k, s in enumerate(self._sums)]
        finite = torch.isfinite(torch.stack([s for sums in figures for s in sums]))
        keys = torch.where(finite, 0, self._first_key)  # 0 where finite
        values = torch.cat([keys.count_nonzero().view(1), keys.topk(self._named).values])
        if self._digits > 1:
            values = (values.unsqueeze(1) // self._powers % self._base).flatten()
        r = self._r
        start = r.rank * self.per_rank
        r.row.extra[start : start + self.per_rank].copy_(values)

    def error(self, summed: Sequence[float]) -> str | None:
        """The error for the summed slots of every rank, or None if no rank found one."""
        r = self._r
        n, size, digits = len(r.params), self.per_rank, self._digits
        found = []
        for rank in range(r.world_size):
            slots = [round(x) for x in summed[rank * size : (rank + 1) * size]]
            values = [
                sum(d * self._base**j for j, d in enumerate(slots[v : v + digits]))
                for v in range(0, size, digits)
            ]
            if values[0]:
                names = [r.names[n - key] for key in values[1:] if key > 0]
                found.append((rank, values[0], names))
        return errors.non_finite(found) if found else None

    def local_error(self) -> str | None:
        """World size 1, no buckets: the same check of the ``.grad`` tensors, read at once."""
        r = self._r
        held = [
            (i, p.grad)
            for i, p in enumerate(r.params)
            if p.grad is not None and p.grad.layout == torch.strided
        ]
        if not held:
            return None
        finite = torch.isfinite(torch.stack([_sum(g) for _, g in held])).tolist()
        bad = [i for (i, _), ok in zip(held, finite, strict=True) if not ok]
        if not bad:
            return None
        return errors.non_finite([(r.rank, len(bad), [r.names[i] for i in bad[:NAMED]])])
