"""Agreement across ranks on the synced buffers: their policies, shapes and dtypes.

Every rank's buffer sync must launch the same collectives, of the same sizes. The ranks
check that they resolved the same policies when the model is wrapped
(:func:`agree_policies`). A buffer registered, deleted, set to None or reassigned with
another shape or dtype after wrapping would break the rule later: the sync leaves such a
buffer out, with a stand-in of the agreed layout in its place
(:meth:`AgreedLayout.with_stand_ins`), and the change travels in the flags of the next
synced backward, where every rank compares its buffers (``BufferSync.agree_layout``). The
ranks adopt the new layout if it is the same everywhere, or raise on every rank.

Both comparisons go through one mechanism, :func:`gather_outcomes`: a fingerprint first,
and each rank's outcome only when the fingerprints differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from .. import _structure
from ..comm import gather_if_different
from .policies import Policy, policy_label

Outcome = tuple[str, Any]
"""What a rank found: ``("ok", view)``, or ``("error", (exception name, message))``."""


def error_outcome(exc: Exception) -> Outcome:
    """The outcome of a rank that failed with ``exc``."""
    return ("error", (type(exc).__name__, str(exc)))


def gather_outcomes(
    mine: Outcome, group: dist.ProcessGroup | None, device: torch.device
) -> list[Outcome]:
    """Every rank's outcome, in rank order; every rank must call it at once.

    The ranks compare fingerprints first (on ``device``), and send their outcomes only if
    those differ (see ``gather_if_different``); otherwise every rank's is this rank's own.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return [mine]
    gathered = gather_if_different(mine, group, device)
    if gathered is None:
        return [mine] * world
    return cast("list[Outcome]", gathered)


def agree_policies(
    policies: dict[str, Policy],
    error: Exception | None,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[str, Policy]:
    """Raise on every rank if any rank failed to resolve, or resolved differently.

    Every rank raises: its own error where it failed, else the first failing rank's error,
    else the first difference from rank 0's policies.
    """
    mine = (
        error_outcome(error)
        if error is not None
        else ("ok", {n: policy_label(p) for n, p in policies.items()})
    )
    outcomes = gather_outcomes(mine, group, device)
    if error is not None:
        raise error
    for rank, (kind, payload) in enumerate(outcomes):
        if kind == "error":
            exc_name, message = payload
            exc_type = {"ValueError": ValueError, "TypeError": TypeError}.get(
                exc_name, RuntimeError
            )
            raise exc_type(f"on rank {rank}: {message}")
    reference = outcomes[0][1]
    for rank, (_, theirs) in enumerate(outcomes):
        if theirs != reference:
            diff = sorted(
                n for n in reference.keys() | theirs.keys() if reference.get(n) != theirs.get(n)
            )
            raise RuntimeError(
                f"ranks resolved different buffer policies: for {diff[:5]} rank 0 has "
                f"{[reference.get(n) for n in diff[:5]]}, rank {rank} has "
                f"{[theirs.get(n) for n in diff[:5]]}; configure_buffer_sync() and "
                "buffer_sync must give the same rules on every rank"
            )
    return policies


def synced_view(
    owners: Mapping[str, tuple[nn.Module, str]], policies: Mapping[str, Policy]
) -> dict[str, str]:
    """What the ranks must agree on for each synced buffer: its layout as text, or for a
    custom policy the function's name (it is called on one buffer at a time)."""
    view = {}
    for name, policy in policies.items():
        if policy == "none":
            continue
        if not isinstance(policy, str):
            view[name] = f"custom policy {policy_label(policy)}"
            continue
        mod, attr = owners[name]
        buf = mod._buffers[attr]
        assert buf is not None
        view[name] = layout_text(buf.shape, buf.dtype)
    return view


def layout_text(shape: torch.Size, dtype: torch.dtype) -> str:
    """A buffer's layout as the errors show it: ``shape [4] float32``."""
    return f"shape {list(shape)} {str(dtype).removeprefix('torch.')}"


class AgreedLayout:
    """The shape and dtype of each synced buffer as the ranks last agreed on them.

    Also what may have changed since on this rank: the buffers the last sync had to leave
    out (``departed``), and the registration count of the model's modules when the ranks
    last compared (``version``, see ``_structure.buffer_version``).
    """

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self.places: dict[str, tuple[torch.dtype, torch.device]] = {}
        self.departed: dict[str, str] = {}  # name -> its layout now, or "None"
        self.version = _structure.buffer_version()

    def record(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the layouts of ``tensors`` (one per synced buffer) as every rank's."""
        self.shapes = {n: (t.shape, t.dtype) for n, t in tensors.items()}
        self.places = {n: (t.dtype, t.device) for n, t in tensors.items()}
        self.departed = {}

    def mark_seen(self) -> None:
        """Note the module registrations up to now as compared across ranks."""
        self.version = _structure.buffer_version()

    @property
    def changed(self) -> bool:
        """Whether this rank's buffers may no longer be those the ranks agreed on.

        True when the last sync left out a buffer whose layout changed (see
        :meth:`with_stand_ins`), or when a module of the model gained or lost a buffer,
        changed one's shape or dtype, or gained a submodule since the ranks last compared
        (torch's registration hooks).
        """
        return bool(self.departed) or _structure.buffer_version() != self.version

    def differs(self, tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """The names in ``tensors`` that are new or have another shape or dtype."""
        return [n for n, t in tensors.items() if self.shapes.get(n) != (t.shape, t.dtype)]

    def with_stand_ins(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor | None],
        baseline: Mapping[str, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """``tensors``, with a stand-in of the agreed layout for each that changed layout.

        A buffer reassigned after wrapping with another shape or dtype, or set to None (on
        some ranks only, say), would make its group's collective differ in size between
        ranks, which hangs or aborts. It is left out instead: a stand-in of the agreed
        shape takes its place (zeros, or for a ``"sum"`` group its entry in ``baseline``,
        which adds nothing), so every rank still launches the same collective, and the
        change is reported to every rank in the next synced backward (:attr:`changed`).
        """
        fitted: list[torch.Tensor] = []
        for name, t in zip(names, tensors, strict=True):
            shape, dtype = self.shapes[name]
            if t is not None and t.shape == shape and t.dtype == dtype:
                fitted.append(t)
                continue
            self.departed[name] = "None" if t is None else layout_text(t.shape, t.dtype)
            if baseline is not None:
                fitted.append(baseline[name])
            else:
                fitted.append(torch.zeros(shape, dtype=dtype, device=self.places[name][1]))
        return fitted

    def compare(
        self, mine: Outcome, group: dist.ProcessGroup | None, device: torch.device
    ) -> str | None:
        """Compare this rank's buffers with every other rank's; every rank calls it at once.

        Args:
            mine: ``("ok", synced_view(...))`` of this rank's buffers, or its error.

        Returns:
            None when every rank holds the same synced buffers, with the same layouts;
            otherwise the error to raise on every rank, naming the first failing rank or
            the first buffer that differs.
        """
        outcomes = gather_outcomes(mine, group, device)
        for rank, (kind, payload) in enumerate(outcomes):
            if kind == "error":
                exc_name, message = payload
                return (
                    "buffers changed after the model was wrapped; on rank "
                    f"{rank}: {exc_name}: {message}"
                )
        views = [payload for _, payload in outcomes]
        for name in dict.fromkeys(n for v in views for n in v):
            seen = [v.get(name) for v in views]
            if any(v != seen[0] for v in seen):
                return self._difference_message(name, seen)
        return None

    def _difference_message(self, name: str, seen: list[str | None]) -> str:
        by_value: dict[str | None, list[int]] = {}
        for rank, value in enumerate(seen):
            by_value.setdefault(value, []).append(rank)
        where = "; ".join(
            f"{'absent or None' if v is None else v} on ranks {r}"
            for v, r in list(by_value.items())[:4]
        )
        was = f" (it was {layout_text(*self.shapes[name])})" if name in self.shapes else ""
        return (
            f"buffer {name!r} changed after the model was wrapped, and not alike on every "
            f"rank: {where}{was}. A synced buffer needs the same shape and dtype on every "
            "rank, so it was left out of the buffer sync. For a buffer holding per-rank data "
            "(a cache, the last batch) or one that only some ranks have, give it the policy "
            f"'none': buffer_sync={{{name!r}: 'none'}}, or in configure_buffer_sync(); "
            "otherwise change it alike on every rank."
        )
