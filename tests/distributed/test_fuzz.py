"""A few fixed seeds of the engine fuzzer (``tools/fuzz_engine.py``), so that it
keeps working; tests/lightning/test_fuzz_lightning.py does the same for the Lightning one.

The fuzzer itself runs outside the suite: ``python3 dev.py fuzz --schedules 200``.
"""

from __future__ import annotations

from fuzz_engine import run_seeds
from fuzz_engine_schedule import make_schedule

# Chosen for what they cover (checked below). World size 2: 1, static_graph, a comm hook,
# SyncBatchNorm and a Stats block under nine buffer rules (exact and patterns) and a
# default policy; 58, uneven join() with no_sync(), a rank-dependent branch, a custom
# default policy on BatchNorm and a layer run twice, the trunk under one plain checkpoint;
# 89, a layer frozen at wrapping and unfrozen, with a comm hook and SyncBatchNorm; 427,
# static_graph with a layer in two reentrant checkpoint segments and the head in a third,
# behind a forward that returns an object the output hooks do not open. World size 3: 60,
# a layer unfrozen and frozen again under uneven join(), with no_sync(), a sparse embedding
# and every buffer policy; 205, the ranks finishing one after another under join(), with
# forward_sync_buffers=False, a "*" rule and a reentrant checkpoint.
SEEDS = (1, 58, 89, 427, 60, 205)


def test_the_smoke_seeds_cover_the_main_features() -> None:
    covered = set().union(*(make_schedule(seed).features() for seed in SEEDS))
    needed = {"join", "uneven", "no_sync", "freeze_switch", "frozen_at_wrap", "hook", "world3"}
    needed |= {"static_graph", "bn", "sparse", "branch", "find_unused_parameters", "no_view"}
    needed |= {"stats", "syncbn", "buffer_pattern", "default_policy", "forward_sync"}
    needed |= {"p_sum", "p_mean", "p_max", "p_min", "p_none", "p_custom", "rank_local"}
    needed |= {"ckpt_plain", "ckpt_reentrant", "head_ckpt", "several_grads", "opaque", "repeat"}
    assert needed <= covered, (
        f"{sorted(needed - covered)} no longer covered: make_schedule changed, pick new seeds"
    )


def test_fuzz_schedules_match_one_process_on_the_global_batch() -> None:
    failed = [
        f"seed {s.seed} ({s.short()}):\n{out.detail}"
        for s, out in run_seeds(SEEDS, group=len(SEEDS))
        if not out.ok
    ]
    assert not failed, "\n".join(failed)
