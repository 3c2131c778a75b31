"""The reducer's state, named and typed in one place, as the plug-ins see it.

``Reducer`` (``core.py``) implements ``ReducerState``; the plug-ins take a
``ReducerState`` rather than the ``Reducer`` itself, so that no module of the package
imports the core back. The plug-in objects the core holds are typed here by what is asked
of them (structural types), so that this module imports no plug-in that takes a state.

Only the ``Reducer`` sets these fields, in ``__init__`` or its own methods: a plug-in
reads them, may change what their objects hold, and returns what changes for the reducer
to take (``tests/unit/test_layout.py`` checks).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..buckets import BucketPlan
from .members import Members
from .module_changes import ModuleChanges
from .sparse import SparseGradients
from .storage import Bucket, BucketStorage


class BufferLayout(Protocol):
    """What the reducer needs of the buffer sync: whether this rank's buffers changed."""

    @property
    def layout_changed(self) -> bool:
        """Whether this rank's buffers may differ from those the ranks last agreed on."""
        ...

    def agree_layout(self) -> str | None:
        """On every rank at once: agree on the buffers anew, or return the error to raise."""
        ...


class Launcher(Protocol):
    """Puts a full bucket on the wire (``launch.py``)."""

    @property
    def averages(self) -> bool:
        """Whether it averages itself (else the slots hold averaged gradients)."""
        ...

    @property
    def extra_collectives(self) -> int:
        """Collectives per step besides one per bucket."""
        ...

    def launch(self, k: int, bucket: Bucket) -> Any:
        """Start reducing bucket ``k``; returns what to wait on."""
        ...

    def wait_all(self, buckets: Sequence[Bucket]) -> None:
        """Wait for every bucket; their storages then hold the sums."""
        ...

    def reduce_copies(
        self,
        storages: list[torch.Tensor],
        buckets: Sequence[Bucket],
        sparse: SparseGradients | None,
    ) -> None:
        """Reduce stand-ins for ``buckets`` (a joined rank's zeros), in launch order."""
        ...


class Row(Protocol):
    """This rank's agreement row on the last bucket (``agreement.py``)."""

    agreed_summed: torch.Tensor
    extra: torch.Tensor  # this rank's view of the finite check's slots

    def write(self, r: ReducerState, *, changes: bool) -> None:
        """Write this rank's row for the step just finished locally."""
        ...

    def summed_is_planned(self) -> bool:
        """Whether the summed row says: every planned parameter everywhere, nothing changed."""
        ...

    def read(self, table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed rows: (counts, agreement)."""
        ...

    def stand_in(self, area: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the row area as a table, and this rank's agreement part in it."""
        ...

    def bind(self, area: torch.Tensor | None) -> None:
        """Take this rank's views from ``area``."""
        ...


class StaticHooks(Protocol):
    """``static_graph=True`` (``static_graph.py``)."""

    def autograd_hook(self, i: int, param: torch.Tensor) -> None:
        """A gradient of parameter ``i``: the last one of the backward goes on."""
        ...

    def before_reduce(self) -> None:
        """At the end of the first synced backward: stage what the hooks only counted."""
        ...

    def reset(self) -> None:
        """A new backward."""
        ...


class FrozenWatch(Protocol):
    """Parameters outside the plan that a rank made trainable (``requires_grad.py``)."""

    trainable: bool

    def before_forward(self) -> None:
        """Hook the parameters outside the plan that now require a gradient."""
        ...

    def forget(self, planned: list[int]) -> None:
        """Unhook the parameters that joined the plan."""
        ...

    def remove(self) -> None:
        """Detach every hook."""
        ...


class Deferred(Protocol):
    """The last bucket, staged at the end of the backward (``deferred.py``)."""

    bucket: Bucket
    members: list[int]  # those with no hook
    blind: bool  # a member's .grad was its slot at the end of a backward

    def hooked(self) -> bool:
        """Whether someone hooked a member since."""
        ...

    def arrivals(
        self, ready: Sequence[bool], params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]
    ) -> list[int]:
        """The members not yet counted ready that got a gradient."""
        ...

    def stage(self, r: ReducerState) -> None:
        """Stage the members counted ready in their slots, at the end of the backward."""
        ...

    def remember(
        self, synced: bool, params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]
    ) -> None:
        """At the end of a backward: note the members' ``.grad``."""
        ...


class FiniteGuard(Protocol):
    """``check_finite=True`` (``finite.py``): NaN and Inf reported through the row."""

    def row_slots(self, dtype: torch.dtype, planned: int) -> int:
        """How many row slots the check needs in a last bucket of ``dtype``."""
        ...

    def install(self) -> None:
        """Take the buckets of a new plan."""
        ...

    def before_launch(self, k: int, bucket: Bucket) -> None:
        """Check bucket ``k``'s gradients; at the last bucket, write this rank's slots."""
        ...

    def error(self, summed: Sequence[float]) -> str | None:
        """The error for the summed slots, or None."""
        ...

    def local_error(self) -> str | None:
        """World size 1: the error for this rank's ``.grad`` tensors, or None."""
        ...


GradientHook = Callable[[int, torch.Tensor], None]


class ReducerState(ABC):
    """What a reducer holds, in small named groups; ``core.Reducer`` implements it."""

    # The model, as wrapped.
    all_named: list[tuple[str, nn.Parameter]]
    all_names: list[str]
    all_params: list[nn.Parameter]
    sparse_names: frozenset[str]  # parameters of embeddings with sparse=True

    # The options and the group.
    process_group: dist.ProcessGroup | None
    world_size: int
    rank: int
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    unused_hint: str
    caps: tuple[int, int]  # bucket_cap_mb and first_bucket_mb, in bytes
    buffer_layout: BufferLayout | None

    # How gradients go on the wire, and over how many ranks they are averaged.
    launcher: Launcher
    communicates: bool  # False with one rank and no comm hook: nothing to reduce
    divisor: int
    training_ranks: int  # ranks that send gradients: fewer under join()

    # The step: whether this backward is ours, and whether it syncs.
    sync_enabled: bool  # no_sync() clears it
    expecting_backward: bool
    sync_step: bool
    touched_elsewhere: bool  # a gradient the ready count does not show arrived

    # The plan and its parameters (set by Reducer._plan_members, from what layout.py builds).
    m: Members
    members: list[int]  # the planned parameters, by index into all of them
    outside: list[int]  # the others: frozen when the plan was made
    names: list[str]
    params: list[nn.Parameter]
    unslotted: frozenset[int]  # planned, but reduced outside the slots (sparse)
    plan: BucketPlan
    observed: list[int] | None  # the ready order, until the plan is rebuilt
    gradient_hooks: list[GradientHook]
    hook_handles: list[RemovableHandle]

    # Per parameter, in this backward and since the last synced one.
    ready: list[bool]
    n_ready: int
    used: list[bool]

    # The bucket storage and where each parameter's slot is (set by Reducer._install).
    storage: BucketStorage
    buckets: list[Bucket]
    views: list[torch.Tensor]
    ptrs: list[int]
    bucket_of: list[Bucket]
    row: Row

    # The plug-ins, built only when needed.
    sparse: SparseGradients | None
    static: StaticHooks | None
    frozen_watch: FrozenWatch | None
    module_changes: ModuleChanges | None
    finite: FiniteGuard | None
    deferred: Deferred | None  # the last bucket, staged at the end of the backward
    defer_allowed: bool

    @property
    def device(self) -> torch.device:
        """Where the reducer's small tensors for collectives live: its buckets' device."""
        return self.buckets[-1].storage.device if self.buckets else torch.device("cpu")

    @property
    @abstractmethod
    def in_backward(self) -> bool:
        """Whether a backward pass of this reducer's is under way."""
        ...

    @abstractmethod
    def autograd_hook(self, i: int, param: torch.Tensor) -> None:
        """Parameter ``i``'s gradient was accumulated."""
        ...

    @abstractmethod
    def unslotted_hook(self, i: int, param: torch.Tensor) -> None:
        """A gradient reduced outside the slots was accumulated."""
        ...

    @abstractmethod
    def mark_variable_ready(self, i: int) -> bool:
        """Record parameter ``i``'s gradient; returns whether to communicate."""
        ...

    @abstractmethod
    def stage(self, i: int, param: torch.Tensor) -> None:
        """Put parameter ``i``'s gradient in its slot, then launch what is due."""
        ...

    @abstractmethod
    def mark_bucket_ready(self, bucket: Bucket) -> None:
        """One gradient of ``bucket`` fewer to wait for."""
        ...

    @abstractmethod
    def fill_slot(self, i: int, grad: torch.Tensor | None) -> torch.Tensor:
        """Stage gradient ``i`` in its slot, averaged; returns the slot."""
        ...

    @abstractmethod
    def used_not_ready(self, i: int) -> None:
        """Parameter ``i`` got a gradient that is not its last: used, not ready yet."""
        ...

    @abstractmethod
    def queue_finalize(self) -> None:
        """Have the autograd engine call the end of backward."""
        ...

    @abstractmethod
    def outside_gradient(self, param: torch.Tensor) -> None:
        """A gradient of a parameter outside the plan arrived."""
        ...

    @abstractmethod
    def use_caps(self, caps: tuple[int, int]) -> None:
        """Plan with bucket sizes ``caps`` (in bytes) from now on, in the current order."""
        ...

    @abstractmethod
    def set_scales(self) -> None:
        """Give each bucket the averaging factors of the next synced backward."""
        ...

    @abstractmethod
    def buffers_changed(self) -> bool:
        """Whether this rank's synced buffers changed layout."""
        ...

    @abstractmethod
    def reset_step(self, *, synced: bool = False) -> None:
        """Ready for the next backward (after a synced one: nothing used either)."""
        ...

    @abstractmethod
    def end_synced_step(self, error: str | None, joined: list[int]) -> None:
        """After a synced backward: raise, take in joining parameters, or rebuild."""
        ...
