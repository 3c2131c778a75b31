"""The agreement row: how the ranks agree on a step's shape without a collective of its own.

The last bucket in plan order carries, after its gradients, one row of numbers per rank.
The bucket's all-reduce sums the rows, so after it every rank reads the same totals:

- **counts**, one per planned parameter. With ``find_unused_parameters=False`` each rank
  writes 1 where the parameter got no gradient: any positive total is an error raised on
  every rank, never a hang. (A parameter frozen on every rank is missing only if it got no
  gradient since the last synced backward; one frozen between ``no_sync()`` micro-batches
  is averaged where any rank had one.) With ``find_unused_parameters=True`` each rank
  writes 1 where it used the parameter: a total of zero means unused everywhere, and its
  ``.grad`` is left untouched, as torch DDP does.
- **requires_grad**, one per model parameter, trainable or not: the ranks on which it
  requires a gradient. A parameter frozen on every rank is skipped; one unfrozen on every
  rank joins the plan at the end of this backward (its gradient for this step is averaged
  then, in one extra collective; see ``requires_grad.py``); one that differs between ranks
  is an error on every rank.
- **module changed**: the ranks whose module gained parameters after wrapping (see
  ``module_changes.py``). Any is an error on every rank.
- **buffers changed**: the ranks whose synced buffers no longer have the shape and dtype
  the ranks agreed on. Then every rank compares its buffers and adopts the new layout if
  every rank has it, or raises.
- **stop**: the ranks that got a stop signal (``notice.py``). Any makes every rank stop
  at this step's boundary.
- **extra**, only with ``check_finite=True``: slots per rank, each rank writing its own,
  for the non-finite gradients it found (see ``finite.py``).

In the common step every rank writes the same row, "as planned", and one comparison of
the summed row with that row times the world size is the whole check.

A float counts ranks exactly only up to 2 / eps (256 in bfloat16, 2048 in float16). Beyond
that the row area holds several rows: rank ``r`` writes row ``r % rows``, and the rows are
added up in float64 after the all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..notice import NOTICE
from . import errors
from .module_changes import changed_message
from .state import ReducerState

FLAGS = 3  # after requires_grad per model parameter: module changed, buffers changed, stop


def row_count(dtype: torch.dtype, world_size: int) -> int:
    """How many rows a bucket of ``dtype`` needs to count ``world_size`` ranks exactly."""
    real = dtype.to_real() if dtype.is_complex else dtype
    exact = int(2 / torch.finfo(real).eps)
    return -(-world_size // exact)


class AgreementRow:
    """This rank's row on the last bucket, what it holds as planned, and how to read sums."""

    def __init__(
        self,
        area: torch.Tensor,
        *,
        planned: int,
        members: Sequence[int],
        reducer: ReducerState,
        extra: int = 0,
    ) -> None:
        """``area`` is the last bucket's row area; ``members`` the planned model parameters;
        ``extra`` the slots of the finite check."""
        self.planned = planned
        self.flags = len(reducer.all_params) + FLAGS  # the agreement part
        self.width = planned + self.flags + extra
        self.rank = reducer.rank
        self.bind(area)
        # What the agreement part holds, before and after the sum, when exactly the planned
        # parameters require a gradient on every rank and nothing changed. (Built from
        # Python lists: each torch operation that training never calls, indexing say, pages
        # in its code, which counts in the resident memory.)
        inside = set(members)
        mask = [float(j in inside) for j in range(self.flags)]
        world = reducer.world_size
        dtype, device = area.dtype, area.device
        self.agreed_summed = torch.tensor(
            [m * world for m in mask] + [0.0] * extra, dtype=torch.float64, device=device
        )
        # This rank's row when every planned parameter got its gradient and nothing changed
        # (counts: none missing, or every one used), and with one row, the sum then.
        row = [float(reducer.find_unused_parameters)] * planned + mask + [0.0] * extra
        self.as_planned = torch.tensor(row, dtype=dtype, device=device)
        self.summed_as_planned = (
            torch.tensor([r * world for r in row], dtype=dtype, device=device)
            if len(self.table) == 1
            else None
        )
        # The same, as host arrays (see ``host_view``); None where the row is not on one.
        self._planned_host = host_view(self.as_planned)
        summed = host_view(self.summed_as_planned)
        self._summed_bytes = summed.tobytes() if summed is not None else None

    @staticmethod
    def numel(
        dtype: torch.dtype, planned: int, model_params: int, world_size: int, extra: int = 0
    ) -> int:
        """The size of the row area for a last bucket of ``dtype``."""
        return row_count(dtype, world_size) * (planned + model_params + FLAGS + extra)

    def bind(self, area: torch.Tensor | None) -> None:
        """Take this rank's views from ``area`` (after the last bucket's storage moved)."""
        assert area is not None
        self.table = area.view(-1, self.width)
        # Views made once, not per step: the first row (the sum, with one row) and this rank's.
        self.first = self.table[0]
        self.mine = mine = self.table[self.rank % len(self.table)]
        end = self.planned + self.flags
        self.counts, self.agreement = mine[: self.planned], mine[self.planned : end]
        self.extra = mine[end:]
        self._first_host, self._mine_host = host_view(self.first), host_view(mine)

    def stand_in(self, area: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``area`` (a copy of the row area) as a table, and this rank's agreement part in it."""
        table = area.view(len(self.table), -1)
        return table, table[self.rank % len(table)][self.planned : self.planned + self.flags]

    def write(self, r: ReducerState, *, changes: bool) -> None:
        """Write this rank's row for the step ``r`` just finished locally.

        ``changes``: a parameter outside the plan requires a gradient, the module changed,
        the buffers changed here, or this rank got a stop signal.
        """
        n = self.planned
        if len(self.table) > 1:
            self.table.zero_()  # the other rows: last step's sums
        if r.n_ready == n and not changes:
            # Every planned parameter got a gradient (so it is used, and requires one), and
            # nothing else changed: the row as planned, in one copy.
            if self._mine_host is not None and self._planned_host is not None:
                self._mine_host[...] = self._planned_host
            else:
                self.mine.copy_(self.as_planned)
            return
        counts = self.counts
        if r.find_unused_parameters:
            if all(r.used):
                counts.fill_(1)
            else:
                counts.copy_(torch.tensor(r.used, dtype=counts.dtype))
        elif r.n_ready == n:
            counts.zero_()
        else:
            # Missing: no gradient in this backward. A parameter frozen here is missing only
            # if it got none since the last synced backward either.
            missing = [
                not (ready or (used and not p.requires_grad))
                for ready, used, p in zip(r.ready, r.used, r.params, strict=True)
            ]
            counts.copy_(torch.tensor(missing, dtype=counts.dtype))
        write_agreement(self.agreement, r)
        self.extra.zero_()  # last step's sums

    def summed_is_planned(self) -> bool:
        """Whether the summed row says: every planned parameter everywhere, nothing changed."""
        expected = self.summed_as_planned
        if expected is None:
            return False
        if self._first_host is not None and self._summed_bytes is not None:
            # Equal bytes are equal values; a sum that differs only in its bits (-0.0)
            # takes the full reading, which compares values.
            return self._first_host.tobytes() == self._summed_bytes
        return torch.equal(self.first, expected)

    def read(self, table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed rows, added up in float64: (counts, agreement with the extra slots)."""
        flags = self.table if table is None else table
        total = (flags.real if flags.is_complex() else flags).to(torch.float64).sum(0)
        return total[: self.planned], total[self.planned :]


def host_view(t: torch.Tensor | None) -> Any | None:
    """A NumPy array on the memory of ``t`` if it is on the CPU, else None.

    The row is written and compared once per step, inside the backward, where a torch call
    goes through the dispatcher with cold caches (about 20 µs for the row's copy and 20
    for its comparison on a 2-core machine); the array's assignment and ``tobytes`` take
    a few. None for a GPU row, a dtype NumPy lacks (bfloat16) or a torch without NumPy:
    those use torch.
    """
    if t is None or t.device.type != "cpu":
        return None
    try:
        return t.numpy()
    except (RuntimeError, TypeError):
        return None


def write_agreement(agreement: torch.Tensor, r: ReducerState) -> None:
    """This rank's agreement part: requires_grad per model parameter, the two changes, and
    whether this rank got a stop signal."""
    local = [p.requires_grad for p in r.all_params]
    changes = [r.module_changes is not None and r.module_changes.reported, r.buffers_changed()]
    agreement.copy_(torch.tensor([*local, *changes, NOTICE.pending], dtype=agreement.dtype))


def check(
    r: ReducerState, counts: torch.Tensor, agreement: torch.Tensor, missing_here: bool
) -> tuple[str | None, list[bool] | None, list[int]]:
    """Read the summed row; returns (error, frozen, joining parameters).

    ``frozen`` is per planned parameter, frozen on every rank (None when every planned
    parameter requires a gradient everywhere); joining parameters are outside the plan
    and now require a gradient on every rank.
    """
    frozen: list[bool] | None = None
    joined: list[int] = []
    if not torch.equal(agreement, r.row.agreed_summed):
        flags = len(r.all_params) + FLAGS
        *ranks, changed, buffers, stop = [round(c) for c in agreement[:flags].tolist()]
        NOTICE.heard(stop)
        if changed:
            return changed_message(r.module_changes, changed, r.world_size), None, []
        if buffers and r.buffer_layout is not None:
            # Every rank is here, having read the same sum: they compare buffers now.
            error = r.buffer_layout.agree_layout()
            if error is not None:
                return error, None, []
        differ = [j for j, c in enumerate(ranks) if 0 < c < r.world_size]
        if differ:
            return differ_message(r, differ, ranks), None, []
        if r.finite is not None and (error := r.finite.error(agreement[flags:].tolist())):
            return error, None, []
        frozen = [ranks[j] == 0 for j in r.members]
        joined = [j for j in r.outside if ranks[j] == r.world_size]
    if not r.find_unused_parameters and (missing_here or bool(counts.any())):
        missing = [c > 0 for c in counts.tolist()]
        if frozen is not None:
            missing = [m and not f for m, f in zip(missing, frozen, strict=True)]
        if any(missing):
            names = [n for n, m in zip(r.names, missing, strict=True) if m]
            return errors.missing(names, r.unused_hint), None, []
    return None, frozen, joined


def check_local(r: ReducerState) -> tuple[str | None, list[int]]:
    """World size 1, no row: the same contract; returns (error, joining parameters)."""
    NOTICE.heard(NOTICE.pending)
    if r.module_changes is not None and r.module_changes.reported:
        return changed_message(r.module_changes, 1, r.world_size), []
    if r.finite is not None and (error := r.finite.local_error()):
        return error, []
    joined = [j for j in r.outside if r.all_params[j].requires_grad]
    if r.find_unused_parameters or r.n_ready == len(r.ready):
        return None, joined
    missing = [
        n
        for n, ready, p in zip(r.names, r.ready, r.params, strict=True)
        if not ready and p.requires_grad
    ]
    return (errors.missing(missing, r.unused_hint) if missing else None), joined


def differ_message(r: ReducerState, differ: list[int], ranks: list[int]) -> str:
    """The error for parameters frozen on some ranks and not on others."""
    return errors.requires_grad_differs(
        [f"{r.all_names[j]} ({ranks[j]} of {r.world_size})" for j in differ]
    )
