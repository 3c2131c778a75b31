"""The engine fuzzer's schedules: what one run does, drawn from one integer seed.

Each *schedule* is a pure function of its seed (``random.Random(seed)``): a world size, a
small model put together from building blocks (``fuzz_engine_model.py`` builds it), engine
options, and 2-5 training steps. ``make_schedule`` draws it; ``Schedule.short`` and
``Schedule.describe`` print it.

Only combinations the docs document as supported are generated: ``static_graph`` only for
a static graph (no rank-dependent branch, no freezing, no ``join()``, no sparse embedding),
no communication hook with a sparse embedding, freezing or unfreezing only before a step
every rank trains, SyncBatchNorm never under ``join()``, ``"sum"`` only on buffers that
are only added to, a policy only on a dtype docs/buffers.md allows it for, and a
parameter in two reentrant segments only with ``static_graph``. The buffer features and
the checkpointing are drawn from random streams of their own
(``random.Random(f"{seed}/buffers")``, ``f"{seed}/checkpoint"``), so the rest of a seed's
schedule is what it was before they were added.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fuzz_engine_buffers import CUSTOM_POLICIES, buffer_table, draw_buffers, resolve_buffers

IN, OUT, VOCAB, TOKENS = 6, 3, 11, 3
TINY_MB = (0.0001, 0.0002, 0.001)  # a few parameters per bucket, or one each
WORLD_SIZES = (2, 3)


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
    """``buffer_sync``, in its order; custom policies by their name in ``CUSTOM_POLICIES``."""
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
            tags.add("p_custom" if policy in CUSTOM_POLICIES else f"p_{policy}")
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


def make_schedule(seed: int, world_sizes: Sequence[int] = WORLD_SIZES) -> Schedule:
    """The schedule of ``seed``: only combinations the docs (docs/engine.md) support."""
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
    # A switch of requires_grad needs every rank training (docs/uneven-inputs.md).
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
    if first is not None and cap is not None and first > cap:
        first = cap  # a first bucket larger than the others is refused
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
    reentrant segments, which needs ``static_graph`` (docs/static-graph.md).
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
