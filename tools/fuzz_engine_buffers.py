"""The engine fuzzer's buffers: which a schedule's model has, and the policies drawn for them.

A schedule's model may have BatchNorm's buffers and a ``Stats`` block's; each has a kind
that decides which policies docs/buffers.md allows for it. ``draw_buffers`` draws the
buffer features of a seed from a random stream of its own, so that the rest of the seed's
schedule does not move when they change.
"""

from __future__ import annotations

import fnmatch
import random
from collections.abc import Sequence
from typing import Any

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
CUSTOM_POLICIES = ("median", "wmean")
"""The custom buffer policies, by name; ``fuzz_engine_model.CUSTOM`` holds their functions."""


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
    # SyncBatchNorm is refused under join() (docs/uneven-inputs.md). Beside the
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
