#!/usr/bin/env python3
"""A seeded, randomized differential fuzzer for ``BucketDataParallel``.

Each *schedule* is a pure function of one integer seed (``random.Random(seed)``): a world
size, a small model put together from building blocks, engine options, and 2-5 training
steps. The schedule trains on real gloo ranks (``tests/support/multirank.py``), and every rank's
parameters and buffers after every step it trains, and at the end, are compared with one
process that trains the same model on the global batch:

- **Gradients.** Each step, every rank still training adds its loss, divided by the world
  size (or, under ``join(divide_by_initial_world_size=False)`` without a communication hook,
  by the number of ranks still training), and backward runs once per rank's batch, so
  BatchNorm sees each rank's batch as the rank does. ``no_sync()`` micro-batches accumulate
  the same way. SGD with momentum 0.9 then steps, and ``zero_grad`` uses the step's
  ``set_to_none``. A parameter that no rank uses keeps its ``.grad``, in both systems.
- **Buffers** (BatchNorm's, and those of an optional ``Stats`` block that counts samples
  and tokens, accumulates, keeps an EMA, a running maximum and minimum, a per-rank value,
  a value for a custom policy and two flags, all updated in forward and read by it). Each
  rank starts from its own values (rank-dependent, set before wrapping). The policies come
  from ``buffer_sync`` rules (exact names and fnmatch patterns, including the custom
  functions ``median_of_ranks`` and ``weighted_mean_of_ranks``), ``default_buffer_policy``,
  ``broadcast_buffers``/``forward_sync_buffers`` and SyncBatchNorm's own ``"none"``. The
  reference resolves them by docs/buffers.md's precedence itself, keeps each rank's
  buffers, and applies docs/buffers.md's semantics: at wrapping every buffer but the
  rank-local ``"none"`` ones takes rank 0's value; before the first forward and before
  each forward that follows a synced one, ``"broadcast"`` takes rank 0's values (under
  ``join()``: the highest rank still training), ``"mean"``/``"max"``/``"min"`` reduce over
  the ranks still training, ``"sum"`` adds every rank's change since the last agreed value
  to it, and a custom function sees every rank's buffer; at the end of ``join()`` the
  ``"broadcast"`` buffers take the values of the highest rank that trained last. Every
  rank's buffers are compared after each step it trains and at the end.
- **SyncBatchNorm** (``convert_sync_batchnorm`` on the BatchNorm layer). The reference runs
  the input layer and plain BatchNorm on the concatenation of the ranks' batches, once per
  rank's running statistics, then the rest of the model on each rank's share, and one
  backward through the sum of the losses.

- **Checkpointing** (``torch.utils.checkpoint``, reentrant or not, only on the ranks). The
  trunk runs in a segment per layer or in one, optionally ``trunk.0`` again at its end and
  the head in a segment of its own; a forward may return an object the wrapper's output
  hooks do not open. Recomputing changes nothing, so the reference runs plainly.

Only combinations the docs document as supported are generated: ``static_graph`` only for
a static graph (no rank-dependent branch, no freezing, no ``join()``, no sparse embedding),
no communication hook with a sparse embedding, freezing or unfreezing only before a step
every rank trains, SyncBatchNorm never under ``join()``, ``"sum"`` only on buffers that
are only added to, a policy only on a dtype docs/buffers.md allows it for, and a
parameter in two reentrant segments only with ``static_graph``. The buffer features and
the checkpointing are drawn from random streams of their own
(``random.Random(f"{seed}/buffers")``, ``f"{seed}/checkpoint"``), so the rest of a seed's
schedule is what it was before they were added.

Usage (``python3 dev.py fuzz ...`` runs it in the project's venv)::

    .venv/bin/python tests/support/fuzz_engine.py --schedules 200 --seed 0
    .venv/bin/python tests/support/fuzz_engine.py --replay 17     # one schedule, described in full

It prints one line per schedule and exits non-zero if any fails, with the ``--replay``
command of each failing seed. The tolerance is ``ATOL``/``RTOL`` plus the rounding a
schedule amplifies (see ``compare``). Schedules of one world size share a launch,
``--group`` seeds at a time, since each rank process spends about two seconds importing
``torch._dynamo`` once; a launch that fails runs again one schedule at a time, so that the
failure names one seed. ``tests/distributed/test_fuzz.py`` runs a few seeds in the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import gc
import random
import re
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.checkpoint import checkpoint

from bucketddp import BucketDataParallel
from bucketddp.syncbn import convert_sync_batchnorm
from multirank import run_ranks

IN, OUT, VOCAB, TOKENS = 6, 3, 11, 3
LR, MOMENTUM = 0.05, 0.9
RTOL = ATOL = 1e-5
TINY_MB = (0.0001, 0.0002, 0.001)  # a few parameters per bucket, or one each
WORLD_SIZES = (2, 3)

# The buffers a schedule's model may have, with their kind: "count" (an integer only added
# to), "acc" (a float only added to), "state" (a float that is rewritten), "flag" (bool).
BN_BUFFERS = (
    ("bn.running_mean", "state"),
    ("bn.running_var", "state"),
    ("bn.num_batches_tracked", "count"),
)
STATS_BUFFERS = (
    ("stats.seen", "count"),  # samples seen
    ("stats.tokens", "count"),  # occurrences of each token
    ("stats.mass", "acc"),  # sum of |activation|
    ("stats.ema", "state"),  # EMA of the mean activation
    ("stats.hi", "state"),  # running maximum
    ("stats.lo", "state"),  # running minimum
    ("stats.own", "state"),  # a per-rank decaying sum
    ("stats.med", "state"),  # an EMA for a custom policy
    ("stats.any_big", "flag"),  # an input feature above FLAG_AT in any batch
    ("stats.all_small", "flag"),  # an input feature below FLAG_AT in every batch
)
FLAG_AT = 2.0
# The policies docs/buffers.md allows for each kind: no "mean" of integers or flags, no
# "sum" of flags or of a buffer not written by adding to it; the custom functions on floats.
ALLOWED = {
    "count": ("sum", "max", "min", "broadcast", "none"),
    "acc": ("sum", "mean", "max", "min", "broadcast", "none", "median", "wmean"),
    "state": ("mean", "max", "min", "broadcast", "none", "median", "wmean"),
    "flag": ("max", "min", "broadcast", "none"),
}
NATURAL = {
    "bn.running_mean": "mean",
    "bn.running_var": "mean",
    "bn.num_batches_tracked": "max",
    "stats.seen": "sum",
    "stats.tokens": "sum",
    "stats.mass": "sum",
    "stats.ema": "mean",
    "stats.hi": "max",
    "stats.lo": "min",
    "stats.own": "none",
    "stats.med": "median",
    "stats.any_big": "max",
    "stats.all_small": "min",
}
PATTERNS = (
    "*",
    "stats.*",
    "bn.*",
    "bn.running_*",
    "*num_batches_tracked",
    "stats.[hl][io]",
    "*_*",
    "stats.m*",
    "*s",
)
ANY_POLICY = ("broadcast", "mean", "sum", "max", "min", "none", "median", "wmean")


def _gathered(buf: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    gathered = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, buf, group=group)
    return gathered


def median_of_ranks(buf: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A custom buffer policy that returns its value: the elementwise median over ranks."""
    return torch.stack(_gathered(buf, group)).median(dim=0).values


def weighted_mean_of_ranks(buf: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """A custom buffer policy that edits in place: the mean over ranks, rank r weighing r+1."""
    buf.copy_(_weighted_mean(_gathered(buf, group)))


def _weighted_mean(values: Sequence[torch.Tensor]) -> torch.Tensor:
    weights = [float(r + 1) for r in range(len(values))]
    total = sum((w * v for w, v in zip(weights, values, strict=True)), torch.zeros_like(values[0]))
    return total / sum(weights)


CUSTOM = {"median": median_of_ranks, "wmean": weighted_mean_of_ranks}


@dataclass(frozen=True)
class Step:
    """One optimizer step of a schedule."""

    micro: int
    """Forward/backward passes in the step; all but the last run inside ``no_sync()``."""
    set_to_none: bool
    """``zero_grad(set_to_none=...)`` after ``opt.step()``."""
    target_trains: bool
    """``requires_grad`` of the freeze target's parameters during this step."""
    branch: tuple[tuple[bool, ...], ...]
    """``branch[micro][rank]``: whether the branch layer runs in that forward."""
    lookup: tuple[tuple[bool, ...], ...]
    """``lookup[micro][rank]``: whether the sparse embedding runs in that forward."""


@dataclass(frozen=True)
class Schedule:
    """Everything one fuzz run does, generated from ``seed`` by ``make_schedule``."""

    seed: int
    world: int
    width: int
    depth: int
    """Hidden ``Linear`` layers after the input layer."""
    tied: bool
    """A token embedding whose weight is also the output projection's."""
    double: bool
    """A float64 ``Linear`` beside the float32 layers."""
    branch: bool
    """A layer run or skipped by rank and step (rank-dependent control flow)."""
    spare: bool
    """A layer no rank ever runs."""
    bn: bool
    sparse: bool
    """An ``nn.Embedding(sparse=True)``."""
    sparse_branch: bool
    """The sparse embedding, too, runs on some ranks and steps only."""
    batch_sizes: tuple[int, ...]
    """Samples per batch, by rank."""
    options: dict[str, Any]
    """Keyword arguments of ``BucketDataParallel``."""
    hook: bool
    """``register_comm_hook(None, allreduce_hook)``."""
    join: bool
    by_initial: bool
    """``join(divide_by_initial_world_size=...)``."""
    batches: tuple[int, ...]
    """Steps each rank trains (all equal without ``join``)."""
    freeze: str | None
    """The module whose parameters are frozen and unfrozen (on every rank alike)."""
    steps: tuple[Step, ...]
    stats: bool = False
    """A ``Stats`` block: buffers updated and read in forward (``STATS_BUFFERS``)."""
    reassign: bool = False
    """The Stats block writes its counters and accumulator by reassignment, not in place."""
    syncbn: bool = False
    """The BatchNorm layer is converted with ``convert_sync_batchnorm``."""
    buffer_rules: tuple[tuple[str, str], ...] = ()
    """``buffer_sync``, in its order; custom policies by their ``CUSTOM`` name."""
    default_policy: str | None = None
    """``default_buffer_policy``, if given."""
    repeat: bool = False
    """``trunk.0`` runs a second time after the last trunk layer (one parameter, two uses)."""
    ckpt: str | None = None
    """The trunk under ``torch.utils.checkpoint``: ``"reentrant"``, ``"plain"`` (not), or None."""
    whole: bool = False
    """One checkpoint segment for the whole trunk instead of one per layer (and repeat)."""
    head_ckpt: bool = False
    """The head runs in a checkpoint segment too (the ``ckpt`` kind): the first gradients
    of a backward may then come from a nested one."""
    opaque: bool = False
    """The ranks' forward returns an object the wrapper's output hooks do not look into."""

    def buffer_policies(self) -> dict[str, tuple[str, bool]]:
        """Each buffer's policy and whether it is rank-local, by docs/buffers.md's rules.

        Precedence: an exact name in ``buffer_sync``, then its first matching pattern, then
        the owning module's default (SyncBatchNorm: ``"none"``), then ``default_buffer_policy``
        (``"broadcast"``, or ``"none"`` when ``broadcast_buffers`` or ``forward_sync_buffers``
        is False). A ``"none"`` is rank-local (kept from each rank at wrapping) if a rule
        gave it, or the default did while ``forward_sync_buffers`` was not given.
        """
        return resolve_buffers(
            [n for n, _ in buffer_table(self.bn, self.stats)],
            self.buffer_rules,
            self.default_policy,
            self.options["broadcast_buffers"],
            self.options.get("forward_sync_buffers"),
            self.syncbn,
        )

    def features(self) -> set[str]:
        """Short tags of what the schedule exercises (for coverage counts and test picks)."""
        tags = {f"world{self.world}"}
        tags |= {
            n for n in ("tied", "double", "branch", "spare", "bn", "sparse") if getattr(self, n)
        }
        tags |= {n for n in ("sparse_branch", "hook", "join") if getattr(self, n)}
        if self.join and len(set(self.batches)) > 1:
            tags.add("uneven")
        for opt in ("find_unused_parameters", "static_graph"):
            if self.options[opt]:
                tags.add(opt)
        if not self.options["gradient_as_bucket_view"]:
            tags.add("no_view")
        if any(s.micro > 1 for s in self.steps):
            tags.add("no_sync")
        if any(not s.set_to_none for s in self.steps):
            tags.add("keep_grads")
        if any(
            a.target_trains != b.target_trains
            for a, b in zip(self.steps, self.steps[1:], strict=False)
        ):
            tags.add("freeze_switch")
        if self.freeze is not None and not self.steps[0].target_trains:
            tags.add("frozen_at_wrap")
        tags |= {n for n in ("stats", "reassign", "syncbn", "repeat") if getattr(self, n)}
        if self.opaque:
            tags.add("opaque")
        if self.ckpt is not None:
            tags.add(f"ckpt_{self.ckpt}")
            if self.head_ckpt:
                tags.add("head_ckpt")
            if self.ckpt == "reentrant" and self.repeat and not self.whole:
                tags.add("several_grads")  # trunk.0 in two reentrant segments
        if self.buffer_rules:
            tags.add("buffer_rules")
        if any(k not in dict(buffer_table(self.bn, self.stats)) for k, _ in self.buffer_rules):
            tags.add("buffer_pattern")
        if self.default_policy is not None:
            tags.add("default_policy")
        if self.options.get("forward_sync_buffers") is not None:
            tags.add("forward_sync")
        for policy, local in self.buffer_policies().values():
            tags.add("p_custom" if policy in CUSTOM else f"p_{policy}")
            if local:
                tags.add("rank_local")
        return tags

    def short(self) -> str:
        """A one-line summary: model | engine | steps."""
        blocks = [f"L{self.depth + 1}x{self.width}"]
        blocks += [
            n for n in ("tied", "double", "branch", "spare", "bn", "sparse") if getattr(self, n)
        ]
        if self.sparse_branch:
            blocks[blocks.index("sparse")] = "sparse(some)"
        if self.syncbn:
            blocks[blocks.index("bn")] = "syncbn"
        if self.stats:
            blocks.append("stats(re)" if self.reassign else "stats")
        if self.repeat:
            blocks[0] += "+t0"
        if self.ckpt is not None:
            how = [
                self.ckpt,
                *(["whole"] if self.whole else []),
                *(["head"] if self.head_ckpt else []),
            ]
            blocks.append(f"ckpt({','.join(how)})")
        if self.opaque:
            blocks.append("opaque")
        o = self.options
        cap, first = o["bucket_cap_mb"], o["first_bucket_mb"]
        engine = [f"cap={'-' if cap is None else f'{cap:g}'}"]
        engine.append(f"first={'-' if first is None else f'{first:g}'}")
        engine.append(f"view={'T' if o['gradient_as_bucket_view'] else 'F'}")
        if o["find_unused_parameters"]:
            engine.append("unused")
        if o["static_graph"]:
            engine.append("static")
        engine.append(f"bb={o['broadcast_buffers']}")
        if o.get("forward_sync_buffers") is not None:
            engine.append(f"fsb={o['forward_sync_buffers']}")
        if self.default_policy is not None:
            engine.append(f"def={self.default_policy}")
        if self.buffer_rules:
            engine.append(f"rules={len(self.buffer_rules)}")
        if self.hook:
            engine.append("hook")
        steps = []
        previous = self.steps[0].target_trains
        for s in self.steps:
            token = "S" if s.micro == 1 else f"A{s.micro}"
            if s.target_trains != previous:
                token = ("U" if s.target_trains else "F") + token
            previous = s.target_trains
            steps.append(token + ("" if s.set_to_none else "k"))
        if self.join:
            by = "init" if self.by_initial else "live"
            steps.append(f"join{list(self.batches)}/{by}")
        return f"w{self.world} {'+'.join(blocks)} | {' '.join(engine)} | {' '.join(steps)}"

    def describe(self) -> str:
        """Everything the schedule does, several lines (printed by ``--replay``)."""
        lines = [f"schedule {self.seed}: world size {self.world}"]
        parts = [f"inp Linear({IN}, {self.width})"]
        if self.bn:
            parts.append(f"bn {'SyncBatchNorm' if self.syncbn else 'BatchNorm1d'}({self.width})")
        parts += [f"trunk.{i} Linear({self.width}, {self.width})" for i in range(self.depth)]
        if self.repeat:
            parts.append("trunk.0 again")
        if self.ckpt is not None:
            segments = "one segment" if self.whole else "a segment per layer"
            head = ", the head in one too" if self.head_ckpt else ""
            parts.append(f"(trunk under {self.ckpt} checkpoint, {segments}{head})")
        if self.opaque:
            parts.append("(forward returns an opaque object)")
        if self.stats:
            how = "reassigned" if self.reassign else "in place"
            parts.append(f"stats Stats({self.width}) (counters written {how})")
        if self.tied:
            parts.append(f"emb Embedding({VOCAB}, {self.width}) tied to out Linear(.., {VOCAB})")
        if self.sparse:
            some = " (some ranks, some steps)" if self.sparse_branch else ""
            parts.append(f"lookup Embedding({VOCAB}, {self.width}, sparse=True){some}")
        if self.double:
            parts.append(f"f64 Linear({self.width}, {self.width}) in float64")
        if self.branch:
            parts.append(f"branch Linear({self.width}, {self.width}) (some ranks, some steps)")
        if self.spare:
            parts.append(f"spare Linear({self.width}, {self.width}) (never run)")
        parts.append(f"head Linear({self.width}, {OUT})")
        lines.append("  model: " + "; ".join(parts))
        lines.append(f"  batch sizes by rank: {list(self.batch_sizes)}")
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        if self.buffer_rules:
            opts += f", buffer_sync={dict(self.buffer_rules)!r}"
        if self.default_policy is not None:
            opts += f", default_buffer_policy={self.default_policy!r}"
        lines.append(f"  BucketDataParallel({opts})")
        if self.bn or self.stats:
            resolved = [
                f"{n}={p}{' (rank-local)' if local else ''}"
                for n, (p, local) in self.buffer_policies().items()
            ]
            lines.append(f"  buffer policies: {', '.join(resolved)}")
        if self.hook:
            lines.append("  register_comm_hook(None, default_hooks.allreduce_hook)")
        if self.join:
            lines.append(
                f"  join(divide_by_initial_world_size={self.by_initial}); "
                f"steps by rank: {list(self.batches)}"
            )
        if self.freeze is not None:
            when = "trainable" if self.steps[0].target_trains else "frozen"
            lines.append(f"  freeze target: {self.freeze} ({when} when wrapped)")
        for i, s in enumerate(self.steps):
            ranks = [r for r in range(self.world) if self.batches[r] > i]
            text = f"  step {i} (ranks {ranks}): "
            text += (
                "1 synced forward" if s.micro == 1 else f"{s.micro - 1} under no_sync + 1 synced"
            )
            if self.freeze is not None:
                text += f", {self.freeze} {'trains' if s.target_trains else 'frozen'}"
            if self.branch:
                text += f", branch on ranks {[[r for r in ranks if m[r]] for m in s.branch]}"
            if self.sparse_branch:
                text += f", lookup on ranks {[[r for r in ranks if m[r]] for m in s.lookup]}"
            text += f", zero_grad(set_to_none={s.set_to_none})"
            lines.append(text)
        return "\n".join(lines)


def buffer_table(bn: bool, stats: bool) -> list[tuple[str, str]]:
    """The model's buffers and their kinds (see ``ALLOWED``)."""
    return [*(BN_BUFFERS if bn else ()), *(STATS_BUFFERS if stats else ())]


def resolve_buffers(
    names: Sequence[str],
    rules: Sequence[tuple[str, str]],
    default: str | None,
    broadcast: bool | None,
    forward_sync: bool | None,
    syncbn: bool,
) -> dict[str, tuple[str, bool]]:
    """Each buffer's policy and whether it is rank-local (``Schedule.buffer_policies``)."""
    exact = dict(rules)
    switch = forward_sync if forward_sync is not None else broadcast
    if default is None:
        default = "none" if switch is False else "broadcast"
    policies = {}
    for name in names:
        ruled = exact.get(name)
        if ruled is None:
            ruled = next((p for k, p in rules if fnmatch.fnmatchcase(name, k)), None)
        if ruled is not None:
            policies[name] = (ruled, ruled == "none")
        elif syncbn and name.startswith("bn."):
            policies[name] = ("none", False)  # SyncBatchNorm's own default: not rank-local
        else:
            policies[name] = (default, default == "none" and forward_sync is None)
    return policies


def draw_buffers(
    seed: int, bn: bool, join: bool, branch: bool, hook: bool, broadcast: bool | None
) -> dict[str, Any]:
    """The buffer features of ``seed``'s schedule, from a random stream of their own.

    Returns the ``Schedule`` fields ``stats``, ``reassign``, ``syncbn``, ``buffer_rules``,
    ``default_policy`` and ``forward_sync`` (``forward_sync_buffers``, or None).
    """
    rng = random.Random(f"{seed}/buffers")
    stats = rng.random() < 0.5
    reassign = stats and rng.random() < 0.3
    # SyncBatchNorm is refused under join() (docs/engine.md, "Uneven inputs"). Beside the
    # rank-dependent branch it found a defect, fixed since (seeds 61, 302 and 538).
    syncbn = rng.random() < 0.5 and bn and not join
    forward_sync = None
    if rng.random() < 0.25:  # given alone, or together with broadcast_buffers (must agree)
        forward_sync = rng.random() < 0.5 if broadcast is None else broadcast
    switch = forward_sync if forward_sync is not None else broadcast
    table = buffer_table(bn, stats)
    default = None
    rules: list[tuple[str, str]] = []
    if table and rng.random() < 0.35:
        # A switch set to False means "none"; one set to True refuses "none".
        choices = [p for p in ANY_POLICY if p != "wmean" and (switch is None or p != "none")]
        default = "none" if switch is False else rng.choice(choices)
    if table and (stats or rng.random() < 0.5):
        names = [n for n, _ in table]
        # A key that matches no buffer is refused: only patterns that match one.
        patterns = [k for k in PATTERNS if any(fnmatch.fnmatchcase(n, k) for n in names)]
        rules = [(k, rng.choice(ANY_POLICY)) for k in rng.sample(patterns, rng.randint(0, 2))]
        for name, kind in table:
            if rng.random() < 0.4:
                policy = NATURAL[name] if rng.random() < 0.5 else rng.choice(ALLOWED[kind])
                rules.insert(rng.randint(0, len(rules)), (name, policy))
    # A buffer left with a policy its kind does not allow gets its natural one by exact
    # name, which beats every pattern and the defaults.
    resolved = resolve_buffers(
        [n for n, _ in table], rules, default, broadcast, forward_sync, syncbn
    )
    for name, kind in table:
        if resolved[name][0] not in ALLOWED[kind]:
            rules.append((name, NATURAL[name]))
    return {
        "stats": stats,
        "reassign": reassign,
        "syncbn": syncbn,
        "buffer_rules": tuple(rules),
        "default_policy": default,
        "forward_sync": forward_sync,
    }


def make_schedule(seed: int, world_sizes: Sequence[int] = WORLD_SIZES) -> Schedule:
    """The schedule of ``seed``: only combinations docs/engine.md documents as supported."""
    rng = random.Random(seed)
    world = rng.choice(list(world_sizes))
    width = rng.choice([4, 6, 8, 12])
    depth = rng.randint(0, 2)
    tied, double, branch = rng.random() < 0.4, rng.random() < 0.35, rng.random() < 0.4
    spare, bn, sparse = rng.random() < 0.25, rng.random() < 0.4, rng.random() < 0.3
    sparse_branch = sparse and rng.random() < 0.5
    # BatchNorm over two samples normalizes them to +-1: gradients through it amplify float
    # rounding by orders of magnitude, so it gets three samples at least.
    batch_sizes = tuple(rng.randint(3 if bn else 2, 5) for _ in range(world))
    n_steps = rng.randint(2, 5)

    join = rng.random() < 0.35
    by_initial = rng.random() < 0.5
    if join:
        batches = [rng.randint(0, n_steps) for _ in range(world)]
        batches[rng.randrange(world)] = n_steps
    else:
        batches = [n_steps] * world
    # A switch of requires_grad needs every rank training (docs/engine.md, join rules).
    switchable = range(1, min(batches))

    # The head always trains, so every backward reaches a parameter on every rank.
    candidates = ["inp", *(f"trunk.{i}" for i in range(depth))]
    candidates += [n for n, on in (("bn", bn), ("emb", tied), ("f64", double)) if on]
    candidates += [n for n, on in (("branch", branch), ("lookup", sparse)) if on]
    freeze = rng.choice(candidates) if rng.random() < 0.45 else None
    # A sparse embedding frozen when wrapped and unfrozen later raises (documented).
    trains = freeze == "lookup" or rng.random() < 0.5

    hook = not sparse and rng.random() < 0.3
    static_ok = not branch and not join and freeze is None and not sparse
    static = static_ok and rng.random() < 0.6
    must_find = branch or sparse_branch or (spare and not static)
    cap = rng.choice([None, 25.0, *TINY_MB])
    first = rng.choice([None, rng.choice(TINY_MB), cap])
    options: dict[str, Any] = {
        "bucket_cap_mb": cap,
        "first_bucket_mb": first,
        "gradient_as_bucket_view": rng.random() < 0.5,
        "find_unused_parameters": must_find or rng.random() < 0.3,
        "static_graph": static,
        "broadcast_buffers": rng.choice([None, True, False]),
    }

    steps = []
    for i in range(n_steps):
        if freeze is not None and i in switchable and rng.random() < 0.5:
            trains = not trains
        micro = 1 if rng.random() < 0.7 else rng.randint(2, 3)
        table = tuple(
            tuple(branch and rng.random() < 0.5 for _ in range(world)) for _ in range(micro)
        )
        lookup = tuple(
            tuple(not sparse_branch or rng.random() < 0.5 for _ in range(world))
            for _ in range(micro)
        )
        steps.append(Step(micro, rng.random() < 0.7, trains, table, lookup))
    buffers = draw_buffers(seed, bn, join, branch, hook, options["broadcast_buffers"])
    forward_sync = buffers.pop("forward_sync")
    if forward_sync is not None:
        options["forward_sync_buffers"] = forward_sync
    buffers |= draw_checkpoint(seed, depth, static)
    return Schedule(
        seed=seed,
        world=world,
        width=width,
        depth=depth,
        tied=tied,
        double=double,
        branch=branch,
        spare=spare,
        bn=bn,
        sparse=sparse,
        sparse_branch=sparse_branch,
        batch_sizes=batch_sizes,
        options=options,
        hook=hook,
        join=join,
        by_initial=by_initial,
        batches=tuple(batches),
        freeze=freeze,
        steps=tuple(steps),
        **buffers,
    )


def draw_checkpoint(seed: int, depth: int, static: bool) -> dict[str, Any]:
    """The trunk's reuse and checkpointing for ``seed``, from a random stream of their own.

    Returns the ``Schedule`` fields ``opaque``, ``repeat``, ``ckpt``, ``whole`` and
    ``head_ckpt``. A parameter gets several gradients in one backward only in several
    reentrant segments, which needs ``static_graph`` (docs/engine.md, "Static graphs").
    """
    rng = random.Random(f"{seed}/checkpoint")
    opaque = rng.random() < 0.3
    if depth == 0:
        return {"opaque": opaque}
    ckpt = rng.choice(["reentrant", "plain"]) if rng.random() < 0.4 else None
    whole = ckpt is not None and rng.random() < 0.3
    several = ckpt == "reentrant" and not whole
    repeat = rng.random() < (0.7 if several and static else 0.35) and (static or not several)
    head_ckpt = ckpt is not None and rng.random() < 0.5
    return {
        "opaque": opaque,
        "repeat": repeat,
        "ckpt": ckpt,
        "whole": whole,
        "head_ckpt": head_ckpt,
    }


class Opaque:
    """A forward's outputs in an object the wrapper's output hooks do not open."""

    def __init__(self, outputs: tuple[torch.Tensor, ...]) -> None:
        self.outputs = outputs


class Stats(nn.Module):
    """Buffers that forward updates from the batch and reads (``STATS_BUFFERS``).

    The output depends on the float buffers, so a buffer synced wrongly shows in the
    parameters too. Counters and flags depend on the inputs alone, so they are exact.
    """

    def __init__(self, width: int, reassign: bool) -> None:
        super().__init__()
        self.reassign = reassign
        self.seen: torch.Tensor
        self.tokens: torch.Tensor
        self.mass: torch.Tensor
        self.ema: torch.Tensor
        self.hi: torch.Tensor
        self.lo: torch.Tensor
        self.own: torch.Tensor
        self.med: torch.Tensor
        self.any_big: torch.Tensor
        self.all_small: torch.Tensor
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("tokens", torch.zeros(VOCAB, dtype=torch.long))
        self.register_buffer("mass", torch.zeros(width))
        self.register_buffer("ema", torch.zeros(width))
        self.register_buffer("hi", torch.full((width,), -0.5))
        self.register_buffer("lo", torch.full((width,), 0.5))
        self.register_buffer("own", torch.zeros(width))
        self.register_buffer("med", torch.zeros(width))
        self.register_buffer("any_big", torch.zeros(IN, dtype=torch.bool))
        self.register_buffer("all_small", torch.ones(IN, dtype=torch.bool))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        out = h + 0.1 * torch.tanh(self.ema + self.own - self.med) + 0.05 * (self.hi + self.lo)
        with torch.no_grad():
            a = h.detach()
            n = torch.tensor(x.shape[0], dtype=torch.long)
            if self.reassign:
                self.seen = self.seen + n
                self.mass = self.mass + a.abs().sum(0)
            else:
                self.seen.add_(n)
                self.mass.add_(a.abs().sum(0))
            self.tokens.add_(torch.bincount(tokens.flatten(), minlength=VOCAB))
            self.ema.mul_(0.8).add_(a.mean(0), alpha=0.2)
            self.hi.copy_(torch.maximum(self.hi, a.amax(0)))
            self.lo.copy_(torch.minimum(self.lo, a.amin(0)))
            self.own.mul_(0.5).add_(a.mean(0))
            self.med.mul_(0.7).add_(a.mean(0) - a.amin(0), alpha=0.3)
            self.any_big |= (x.abs() > FLAG_AT).any(0)
            self.all_small &= (x.abs() < FLAG_AT).all(0)
        return out


class FuzzNet(nn.Module):
    """The schedule's model: optional blocks around an input layer and a head."""

    def __init__(self, s: Schedule) -> None:
        super().__init__()
        w = s.width
        self.inp = nn.Linear(IN, w)
        self.bn = nn.BatchNorm1d(w) if s.bn else None
        self.trunk = nn.ModuleList(nn.Linear(w, w) for _ in range(s.depth))
        self.repeat = s.repeat
        # Set on the ranks' models only (see ``train_rank``).
        self.ckpt: str | None = None
        self.opaque = False
        self.whole = s.whole
        self.head_ckpt = s.head_ckpt
        self.stats = Stats(w, s.reassign) if s.stats else None
        self.emb = nn.Embedding(VOCAB, w) if s.tied else None
        self.out = nn.Linear(w, VOCAB, bias=False) if s.tied else None
        if self.out is not None and self.emb is not None:
            self.out.weight = self.emb.weight
        self.lookup = nn.Embedding(VOCAB, w, sparse=True) if s.sparse else None
        self.f64 = nn.Linear(w, w).double() if s.double else None
        self.branch = nn.Linear(w, w) if s.branch else None
        self.spare = nn.Linear(w, w) if s.spare else None
        self.head = nn.Linear(w, OUT)

    def forward(
        self, x: torch.Tensor, tokens: torch.Tensor, use_branch: bool, use_lookup: bool
    ) -> tuple[torch.Tensor, ...] | Opaque:
        out = self.rest(self.front(x), x, tokens, use_branch, use_lookup)
        return Opaque(out) if self.opaque else out

    def front(self, x: torch.Tensor) -> torch.Tensor:
        """The input layer and BatchNorm: the part the SyncBatchNorm reference runs globally."""
        h = self.inp(x)
        if self.bn is not None:
            h = self.bn(h)
        return h

    def rest(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        tokens: torch.Tensor,
        use_branch: bool,
        use_lookup: bool,
    ) -> tuple[torch.Tensor, ...]:
        """Everything after ``front``."""
        h = self.run_trunk(torch.tanh(h))
        if self.stats is not None:
            h = self.stats(x, tokens, h)
        if self.emb is not None:
            h = h + self.emb(tokens).mean(dim=1)
        if self.lookup is not None and use_lookup:
            h = h + self.lookup(tokens).mean(dim=1)
        if self.f64 is not None:
            h = h + torch.tanh(self.f64(h.double())).to(h.dtype)
        if self.branch is not None and use_branch:
            h = h + torch.tanh(self.branch(h))
        y = self.segment(self.head, h) if self.head_ckpt else self.head(h)
        if self.out is None:
            return (y,)
        return y, self.out(h)

    def run_trunk(self, h: torch.Tensor) -> torch.Tensor:
        """The trunk layers (``trunk.0`` again if ``repeat``), checkpointed if ``ckpt``.

        Reentrant checkpointing needs an input that requires a gradient: without one (the
        input layer frozen, no BatchNorm) the trunk runs plainly, as in the reference.
        """
        layers = [*self.trunk, *self.trunk[:1]] if self.repeat else list(self.trunk)
        if self.ckpt is None or not h.requires_grad:
            return _chain(layers, h)  # decided once, at the trunk's input
        if self.whole:
            return self.segment(functools.partial(_chain, layers), h)
        for layer in layers:
            h = self.segment(functools.partial(_chain, [layer]), h)
        return h

    def segment(self, fn: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """``fn(h)``, in a checkpoint segment of the ``ckpt`` kind if there is one to make."""
        if self.ckpt is None or not h.requires_grad:
            return fn(h)
        out = checkpoint(fn, h, use_reentrant=self.ckpt == "reentrant")
        return cast(torch.Tensor, out)


def _chain(layers: Sequence[nn.Module], h: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        h = torch.tanh(layer(h))
    return h


def build_model(s: Schedule) -> FuzzNet:
    """The schedule's model, initialized from its seed; the freeze target as when wrapped."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        model = FuzzNet(s)
    set_target(model, s, s.steps[0].target_trains)
    return model


def set_target(model: nn.Module, s: Schedule, trains: bool) -> None:
    if s.freeze is not None:
        model.get_submodule(s.freeze).requires_grad_(trains)


def batch(s: Schedule, step: int, micro: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s inputs and targets for one forward: a function of the indices only."""
    g = torch.Generator().manual_seed(
        random.Random(f"{s.seed}/{step}/{micro}/{rank}").getrandbits(62)
    )
    n = s.batch_sizes[rank]
    x = torch.randn(n, IN, generator=g)
    tokens = torch.randint(0, VOCAB, (n, TOKENS), generator=g)
    y = torch.randn(n, OUT, generator=g)
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    return x, tokens, y, labels


def loss_of(out: tuple[torch.Tensor, ...], y: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(out[0], y)
    if len(out) > 1:
        loss = loss + F.cross_entropy(out[1], labels)
    return loss


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _rank_values(values: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Buffer values as rank ``rank`` has them before wrapping: each rank's differ."""
    out = {}
    for name, b in values.items():
        if b.dtype == torch.bool:
            out[name] = b ^ (rank % 2 == 1)
        elif b.is_floating_point():
            out[name] = b + 0.05 * rank
        else:
            out[name] = b + rank
    return out


def wrapper_options(s: Schedule) -> dict[str, Any]:
    """The keyword arguments of ``BucketDataParallel``: the options and the buffer policies."""
    kwargs = dict(s.options)
    if s.buffer_rules:
        kwargs["buffer_sync"] = {k: CUSTOM.get(p, p) for k, p in s.buffer_rules}
    if s.default_policy is not None:
        kwargs["default_buffer_policy"] = CUSTOM.get(s.default_policy, s.default_policy)
    return kwargs


def train_rank(rank: int, world: int, s: Schedule) -> dict[str, Any]:
    """Run the schedule through ``BucketDataParallel`` on this rank (a ``run_ranks`` target)."""
    model = build_model(s)
    model.ckpt, model.opaque = s.ckpt, s.opaque
    if s.syncbn:
        convert_sync_batchnorm(model)
    with torch.no_grad():
        for name, value in _rank_values(_buffers(model), rank).items():
            model.get_buffer(name).copy_(value)
    wrapped = BucketDataParallel(model, **wrapper_options(s))
    if s.hook:
        wrapped.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    snapshots, buffer_snapshots = [], []
    # Only build the Join when it is used: torch's Join() switches its joinables' join
    # mode on as soon as it is constructed, entered or not.
    joined = wrapped.join(divide_by_initial_world_size=s.by_initial) if s.join else None
    with joined if joined is not None else contextlib.nullcontext():
        for i in range(s.batches[rank]):
            step = s.steps[i]
            set_target(model, s, step.target_trains)
            for m in range(step.micro):
                synced = m == step.micro - 1
                with contextlib.nullcontext() if synced else wrapped.no_sync():
                    x, tokens, y, labels = batch(s, i, m, rank)
                    out = wrapped(x, tokens, step.branch[m][rank], step.lookup[m][rank])
                    if isinstance(out, Opaque):
                        out = out.outputs
                    loss_of(out, y, labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=step.set_to_none)
            snapshots.append(_params(model))
            buffer_snapshots.append(_buffers(model))
    return {
        "steps": snapshots,
        "step_buffers": buffer_snapshots,
        "params": _params(model),
        "buffers": _buffers(model),
    }


def reference(s: Schedule, precise: bool = False) -> dict[str, Any]:
    """One process on the global batch: parameters after each step and at the end, buffers
    by rank after each step and at the end.

    ``precise`` trains in float64 throughout; the difference from the float32 run tells how
    far float rounding alone moves each tensor (see ``compare``).
    """
    model = build_model(s)
    if precise:
        model.double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    policies = s.buffer_policies()
    start = _buffers(model)
    if start.keys() != policies.keys():
        raise AssertionError(f"buffers {sorted(start)} but policies for {sorted(policies)}")
    # At wrapping every buffer takes rank 0's value, except the rank-local "none" ones.
    rank_buffers = [_rank_values(start, r) for r in range(s.world)]
    for name, (_, local) in policies.items():
        for r in range(1, s.world):
            if not local:
                rank_buffers[r][name] = rank_buffers[0][name].clone()
    # "sum": the value every rank last agreed on.
    agreed = {n: rank_buffers[0][n].clone() for n, (p, _) in policies.items() if p == "sum"}
    sync_next = True  # before the first forward, and after each synced one
    snapshots, buffer_snapshots = [], []
    for i, step in enumerate(s.steps):
        training = [r for r in range(s.world) if s.batches[r] > i]
        # A communication hook divides by itself (allreduce_hook: by the group's size).
        by_world = not s.join or s.by_initial or s.hook
        divisor = s.world if by_world else len(training)
        set_target(model, s, step.target_trains)
        for m in range(step.micro):
            if sync_next:
                # Under join() "broadcast" takes the highest rank still training.
                src = training[-1] if s.join else 0
                _sync_reference(policies, rank_buffers, agreed, training, src)
            inputs = {}
            for r in training:
                x, tokens, y, labels = batch(s, i, m, r)
                if precise:
                    x, y = x.double(), y.double()
                inputs[r] = (x, tokens, y, labels)
            if s.syncbn:
                _global_bn_step(model, s, step, m, inputs, rank_buffers, divisor)
            else:
                for r in training:
                    x, tokens, y, labels = inputs[r]
                    _load_buffers(model, rank_buffers[r])
                    out = model(x, tokens, step.branch[m][r], step.lookup[m][r])
                    (loss_of(out, y, labels) / divisor).backward()
                    rank_buffers[r] = _buffers(model)
            sync_next = m == step.micro - 1
        opt.step()
        opt.zero_grad(set_to_none=step.set_to_none)
        snapshots.append(_params(model))
        buffer_snapshots.append([dict(b) for b in rank_buffers])
    if s.join:
        # At the end of join(), "broadcast" buffers take a last joiner's values.
        last = max(r for r in range(s.world) if s.batches[r] == len(s.steps))
        for name, (policy, _) in policies.items():
            if policy == "broadcast":
                for r in range(s.world):
                    rank_buffers[r][name] = rank_buffers[last][name]
    return {
        "steps": snapshots,
        "step_buffers": buffer_snapshots,
        "params": _params(model),
        "buffers": rank_buffers,
    }


def _sync_reference(
    policies: dict[str, tuple[str, bool]],
    rank_buffers: list[dict[str, torch.Tensor]],
    agreed: dict[str, torch.Tensor],
    training: Sequence[int],
    src: int,
) -> None:
    """One buffer sync as docs/buffers.md describes it, on every rank's values in place."""
    world = len(rank_buffers)
    for name, (policy, _) in policies.items():
        if policy == "none":
            continue
        values = [b[name] for b in rank_buffers]
        live = torch.stack([values[r] for r in training])
        if policy == "broadcast":
            new = [values[src]] * world
        elif policy == "sum":
            # Every rank's change since the last agreed value, including a joined rank's.
            base = agreed[name]
            total = base + torch.stack([v - base for v in values]).sum(0)
            agreed[name] = total
            new = [total] * world
        elif policy == "mean":
            new = [live.sum(0) / len(training)] * world
        elif policy == "max":
            new = [live.any(0) if live.dtype == torch.bool else live.amax(0)] * world
        elif policy == "min":
            new = [live.all(0) if live.dtype == torch.bool else live.amin(0)] * world
        elif policy == "median":  # median_of_ranks, on every rank's buffer (joined or not)
            new = [torch.stack(values).median(dim=0).values] * world
        elif policy == "wmean":  # weighted_mean_of_ranks, likewise
            new = [_weighted_mean(values)] * world
        else:
            raise AssertionError(f"no reference for buffer policy {policy!r}")
        for r in range(world):
            rank_buffers[r][name] = new[r].clone()


def _global_bn_step(
    model: FuzzNet,
    s: Schedule,
    step: Step,
    m: int,
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    rank_buffers: list[dict[str, torch.Tensor]],
    divisor: int,
) -> None:
    """One forward and backward of every rank with SyncBatchNorm, as one process would.

    BatchNorm sees the concatenation of the ranks' batches: its output (batch statistics)
    is the same whatever running statistics it holds, so it runs once with autograd, and
    once more per other rank, without, to update that rank's running statistics from the
    global batch. The rest of the model runs on each rank's share with that rank's buffers,
    and one backward goes through the sum of the ranks' losses.
    """
    assert model.bn is not None
    ranks = list(inputs)
    h = model.inp(torch.cat([inputs[r][0] for r in ranks]))
    normed: torch.Tensor | None = None
    for r in ranks:
        _load_buffers(model, rank_buffers[r])
        if normed is None:
            normed = model.bn(h)
        else:
            with torch.no_grad():
                model.bn(h.detach())
        rank_buffers[r] = _buffers(model)
    assert normed is not None
    total = torch.zeros((), dtype=normed.dtype)
    shares = normed.split([inputs[r][0].shape[0] for r in ranks])
    for r, share in zip(ranks, shares, strict=True):
        x, tokens, y, labels = inputs[r]
        _load_buffers(model, rank_buffers[r])
        out = model.rest(share, x, tokens, step.branch[m][r], step.lookup[m][r])
        total = total + loss_of(out, y, labels) / divisor
        rank_buffers[r] = _buffers(model)
    total.backward()


def _load_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Give the model's buffers these values, as new tensors: a tensor that a forward saved
    for its backward (BatchNorm's running statistics) is left as it was."""
    for name, value in values.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = value.detach().clone()


@dataclass
class Outcome:
    """The verdict on one schedule."""

    seed: int
    ok: bool
    error: float
    """The largest absolute difference from the reference."""
    seconds: float
    detail: str = ""
    """The first mismatches, or the failing rank's traceback."""


def compare(s: Schedule, ranks: Sequence[dict[str, Any]]) -> tuple[float, list[str]]:
    """The largest difference from the reference, and a line per tensor out of tolerance.

    Every rank's parameters and buffers after each step it trained, and its final
    parameters and buffers, must be within ``ATOL + RTOL * |reference|`` of the float32
    reference, plus four times the largest difference between the float32 and the float64
    reference in that tensor. The last term is float rounding, which an ill-conditioned
    schedule (a BatchNorm over a few samples) amplifies over the steps in any two float32
    runs; it is zero for most tensors.
    """
    want, exact = reference(s), reference(s, precise=True)
    worst, bad = 0.0, []

    def check(
        got: dict[str, torch.Tensor],
        ref: dict[str, torch.Tensor],
        ref64: dict[str, torch.Tensor],
        where: str,
    ) -> None:
        nonlocal worst
        if got.keys() != ref.keys():
            bad.append(f"{where}: names differ: {sorted(got.keys() ^ ref.keys())}")
            return
        for name, r in ref.items():
            g = got[name]
            if g.shape != r.shape or g.dtype != r.dtype:
                bad.append(f"{where} {name}: {g.dtype}{list(g.shape)} vs {r.dtype}{list(r.shape)}")
                continue
            g, r = g.double(), r.double()
            diff = (g - r).abs()
            if not diff.numel():
                continue
            noise = float((r - ref64[name].double()).abs().max())
            err = float(diff.max())
            worst = max(worst, err)
            if not bool((diff <= ATOL + RTOL * r.abs() + 4 * noise).all()):
                bad.append(f"{where} {name}: max abs error {err:.3g} (rounding {noise:.2g})")

    for rank, got in enumerate(ranks):
        for i, params in enumerate(got["steps"]):
            check(params, want["steps"][i], exact["steps"][i], f"rank {rank} after step {i}")
        for i, bufs in enumerate(got["step_buffers"]):
            where = f"rank {rank} buffers after step {i}"
            check(bufs, want["step_buffers"][i][rank], exact["step_buffers"][i][rank], where)
        check(got["params"], want["params"], exact["params"], f"rank {rank} final")
        where = f"rank {rank} final buffers"
        check(got["buffers"], want["buffers"][rank], exact["buffers"][rank], where)
    return worst, bad


def train_group(rank: int, world: int, schedules: Sequence[Schedule]) -> list[dict[str, Any]]:
    """``train_rank`` for several schedules in turn, in one process group.

    A rank process imports ``torch._dynamo`` (through ``torch.optim``) the first time it
    builds an optimizer, about two seconds: a group pays that once.
    """
    # Import it before the first timing, so that each schedule's time is its own.
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    results = []
    for s in schedules:
        start = time.perf_counter()
        try:
            result = train_rank(rank, world, s)
        except Exception as err:
            raise RuntimeError(f"fuzz schedule {s.seed} raised on rank {rank}") from err
        result["seconds"] = time.perf_counter() - start
        results.append(result)
        gc.collect()  # the wrapper and its hooks go before the next schedule's
    return results


def run_group(schedules: Sequence[Schedule], timeout: float = 60.0) -> list[Outcome]:
    """Train schedules of one world size in one launch and judge each against its reference.

    If a rank raises or the launch times out, each schedule runs again in a launch of its
    own, so that the failure is pinned on one seed. Should every one of them pass alone,
    the failure depends on the schedules before it in the same processes: the seed the
    error names (or, after a hang, every seed of the group) fails, and says so.
    """
    world = schedules[0].world
    assert all(s.world == world for s in schedules)
    start = time.monotonic()
    try:
        # A schedule takes well under a second once the ranks have imported torch._dynamo.
        limit = timeout + 5.0 * (len(schedules) - 1)
        by_rank = run_ranks(train_group, world, list(schedules), timeout=limit)
    except Exception as err:  # a rank raised, died or hung
        text = str(err) or traceback.format_exc()
        if len(schedules) == 1:
            seconds = time.monotonic() - start
            return [Outcome(schedules[0].seed, False, float("nan"), seconds, text)]
        alone = [out for s in schedules for out in run_group([s], timeout)]
        if not all(out.ok for out in alone):
            return alone
        named = re.search(r"fuzz schedule (\d+) raised", text)
        blamed = {int(named.group(1))} if named else {s.seed for s in schedules}
        seeds = [s.seed for s in schedules]
        n = seeds[-1] - seeds[0] + 1
        note = (
            f"failed in one launch with seeds {seeds} (world size {world}) but passed alone, "
            "so it depends on the schedules run before it in the same processes; rerun "
            f"that launch with --seed {seeds[0]} --schedules {n} --group {n}:\n{text}"
        )
        for out in alone:
            if out.seed in blamed:
                out.ok, out.detail = False, note
        return alone
    outcomes = []
    for k, s in enumerate(schedules):
        ranks = [results[k] for results in by_rank]
        begin = time.monotonic()
        worst, bad = compare(s, ranks)
        seconds = max(r["seconds"] for r in ranks) + time.monotonic() - begin
        if len(schedules) == 1:
            seconds = time.monotonic() - start
        more = [f"... and {len(bad) - 8} more"] if len(bad) > 8 else []
        outcomes.append(Outcome(s.seed, not bad, worst, seconds, "\n".join(bad[:8] + more)))
    return outcomes


def run_seeds(
    seeds: Sequence[int],
    world_sizes: Sequence[int] = WORLD_SIZES,
    timeout: float = 60.0,
    group: int = 20,
) -> Iterator[tuple[Schedule, Outcome]]:
    """Generate and run the schedules of ``seeds``, ``group`` seeds at a time; yield in order."""
    for i in range(0, len(seeds), group):
        schedules = [make_schedule(seed, world_sizes) for seed in seeds[i : i + group]]
        outcomes: dict[int, Outcome] = {}
        for world in sorted({s.world for s in schedules}):
            for out in run_group([s for s in schedules if s.world == world], timeout):
                outcomes[out.seed] = out
        for s in schedules:
            yield s, outcomes[s.seed]


def _replay_command(seed: int, world_sizes: Sequence[int]) -> str:
    cmd = f"python3 dev.py fuzz --replay {seed}"
    if tuple(world_sizes) != WORLD_SIZES:
        cmd += f" --world-sizes {','.join(map(str, world_sizes))}"
    return cmd


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=50, help="schedules to run (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="the first schedule's seed (default 0)")
    parser.add_argument("--replay", type=int, help="run the one schedule of this seed, described")
    parser.add_argument(
        "--world-sizes",
        default=",".join(map(str, WORLD_SIZES)),
        help="comma-separated world sizes to draw from (default 2,3); part of a schedule",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per schedule")
    parser.add_argument(
        "--group", type=int, default=20, help="seeds per batch of launches (1: a launch each)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    world_sizes = tuple(int(w) for w in args.world_sizes.split(","))

    if args.replay is not None:
        s = make_schedule(args.replay, world_sizes)
        print(s.describe(), flush=True)
        [out] = run_group([s], args.timeout)
        verdict = "PASS" if out.ok else "FAIL"
        print(f"max abs error {out.error:.3g}, {out.seconds:.1f}s: {verdict}")
        if out.detail:
            print(out.detail)
        return 0 if out.ok else 1

    failed: list[Outcome] = []
    coverage: Counter[str] = Counter()
    start = time.monotonic()
    seeds = range(args.seed, args.seed + args.schedules)
    for s, out in run_seeds(seeds, world_sizes, args.timeout, max(1, args.group)):
        coverage.update(s.features())
        verdict = "PASS" if out.ok else "FAIL"
        print(f"{s.seed:6d}  {s.short():<88s} err {out.error:7.2g} {out.seconds:5.1f}s  {verdict}")
        if not out.ok:
            failed.append(out)
            print("        " + out.detail.replace("\n", "\n        "))
        sys.stdout.flush()
    took = time.monotonic() - start
    print(f"\n{args.schedules - len(failed)} of {args.schedules} schedules passed in {took:.0f}s")
    print("coverage: " + ", ".join(f"{k} {v}" for k, v in sorted(coverage.items())))
    for out in failed:
        print(f"FAILED seed {out.seed}: replay with {_replay_command(out.seed, world_sizes)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
